"""Fused small ops: each is one plain-torch function (the reference, and what a CPU runs eagerly) that
torch.compile turns into one or two kernels, where eager PyTorch launches one kernel per operation.

They compute what lesson 01's model computes, in the same dtypes, so the eager tokens stay the tokens.
"""
import functools

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Lesson 01's RMSNorm: normalise in float32, cast back, scale by weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add and the next norm in one pass."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for gate and up packed side by side in the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D/2]: pair j with j + D/2, without building rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3's per-head q/k RMSNorm, then RoPE (Llama models pass weight None: RoPE only)."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return rope(q, cos, sin), rope(k, cos, sin)


def rope_table(max_positions: int, head_dim: int, theta: float, dtype) -> torch.Tensor:
    """cos and sin of every position's angles, [max_positions, 2, D/2], computed once as lesson 01 does
    per step (float32, then cast): the forward only looks rows up."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype)


class FusedOps:
    """The ops a fused model calls: the plain functions above, or their torch.compile'd versions.

    dynamic=True: one compiled kernel serves every number of tokens (sizes 0 and 1 still get their own)."""

    NAMES = ("rms_norm", "add_rms_norm", "silu_and_mul", "qk_norm_rope")

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        for name in self.NAMES:
            fn = globals()[name]
            setattr(self, name, _compile(fn) if compiled else fn)


@functools.cache
def _compile(fn):
    """One compiled function per op, shared by every model in the process (compiling is slow)."""
    return torch.compile(fn, dynamic=True, fullgraph=True)

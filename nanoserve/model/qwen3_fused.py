"""Lesson 01's Qwen3 with its small operations fused: q, k and v as one matmul, gate and up as one, the
residual add inside the next RMSNorm, q/k-norm with RoPE, SiLU with the multiply, and RoPE's cos/sin
looked up from a table. Same checkpoints, same results, a third of the kernel launches.

Packed weights still load tensor by tensor: `checkpoint_tensors()` maps each checkpoint name (q_proj,
k_proj, ...) to its rows of the packed matrix, so a loader (and lesson 07's, which loads one shard of
each) never needs the unpacked model.
"""
from typing import Any

import torch
from torch import nn

from nanoserve.kernels.fused import FusedOps, rope_table
from nanoserve.model.config import ModelConfig
from nanoserve.model.qwen3 import AttentionBackend, RMSNorm


class PackedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, ops: FusedOps):
        super().__init__()
        self.layer_idx, self.ops, self.eps = layer_idx, ops, config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.sizes = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2  # q, k, v
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(self.sizes[0], config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, backend: AttentionBackend, meta: Any = None) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        weights = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        q, k = self.ops.qk_norm_rope(q, k, *weights, self.eps, cos, sin)
        out = backend.attend(self.layer_idx, q, k, v.view(T, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj(out.reshape(T, self.sizes[0]))


class PackedMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: FusedOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class FusedDecoderLayer(nn.Module):
    """Takes and returns (normed input, residual): each layer's last add happens in the next layer's
    first norm (or the final norm), one kernel for both."""

    def __init__(self, config: ModelConfig, layer_idx: int, ops: FusedOps):
        super().__init__()
        self.ops, self.eps = ops, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PackedAttention(config, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = PackedMLP(config, ops)

    def forward(self, x, residual, cos, sin, backend: AttentionBackend, meta: Any = None):
        if residual is None:  # the first layer: nothing to add yet
            x, residual = self.ops.rms_norm(x, self.input_layernorm.weight, self.eps), x
        else:
            x, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        x = self.self_attn(x, cos, sin, backend, meta)
        x, residual = self.ops.add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(x), residual


class FusedQwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, ops: FusedOps):
        super().__init__()
        self.config, self.ops = config, ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FusedDecoderLayer(config, i, ops) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = None  # cos/sin of every position: made at the first forward, on the weights' device

    def forward(self, input_ids, positions, backend: AttentionBackend, meta: Any = None) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.rope is None or self.rope.device != x.device or self.rope.dtype != x.dtype:
            c = self.config
            self.rope = rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta, x.dtype).to(x.device)
        cos, sin = self.rope[positions].unbind(dim=1)  # [T, D/2] each: one lookup per step
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, backend, meta)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.config.rms_norm_eps)[0]


class FusedQwen3ForCausalLM(nn.Module):
    """Drop-in for Qwen3ForCausalLM (same forward, compute_logits and checkpoints), with fused ops;
    compiled=True runs them through torch.compile."""

    def __init__(self, config: ModelConfig, compiled: bool = False):
        super().__init__()
        self.config = config
        self.model = FusedQwen3Model(config, FusedOps(compiled))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, backend: AttentionBackend, meta: Any = None) -> torch.Tensor:
        return self.model(input_ids, positions, backend, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> where it goes: a parameter, or its rows of a packed one."""
        out = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if name.endswith("qkv_proj.weight"):
                prefix = name[: -len("qkv_proj.weight")]
                sizes = self.model.layers[0].self_attn.sizes
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), param.split(sizes)):
                    out[f"{prefix}{part}.weight"] = rows
            elif name.endswith("gate_up_proj.weight"):
                prefix = name[: -len("gate_up_proj.weight")]
                out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = param.chunk(2)
            else:
                out[name] = param
        return out

"""Prototype for issue 24's per-step floor: a Triton matrix-vector product for one-row linears and one
Triton kernel for q/k-norm + RoPE, patched into a built LLM before its graphs are recorded; the batch-1
speed, replay time, kernel count and agreement against the same engine unpatched, in one process. GPU only.

    python bench/proto_step_kernels.py OUT.json
"""
import json
import sys
import time

import torch
import triton
import triton.language as tl

from nanoserve.bench import bench_batch1
from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams

sys.path.insert(0, "bench")
from gpu_step_floor import replay_kernels, replay_ms  # noqa: E402


@triton.jit
def _gemv_kernel(x, w, y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + cols[None, :], mask=rows[:, None] < N, other=0.0)
        acc += tile.to(tl.float32) * tl.load(x + cols).to(tl.float32)[None, :]
    tl.store(y + rows, tl.sum(acc, axis=1).to(y.dtype.element_ty), mask=rows < N)


def linear(x, weight):
    N, K = weight.shape
    if x.shape[0] != 1 or not x.is_cuda or x.dtype == torch.float32 or K % 512:
        return torch.nn.functional.linear(x, weight)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    block_n, warps = (2, 2) if N >= 4096 else (4, 4)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight, y, N, K=K, BLOCK_N=block_n, BLOCK_K=512,
                                             num_warps=warps)
    return y


@triton.jit
def _qk_norm_rope_kernel(q, k, q_w, k_w, cos, sin, q_out, k_out, eps, stride_q, stride_k,
                         HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, HALF)
    is_q = h < HQ
    if is_q:
        src, dst, w = q + t * stride_q + h * 2 * HALF, q_out + (t * HQ + h) * 2 * HALF, q_w
    else:
        src, dst, w = k + t * stride_k + (h - HQ) * 2 * HALF, k_out + (t * HK + h - HQ) * 2 * HALF, k_w
    x1 = tl.load(src + j).to(tl.float32)
    x2 = tl.load(src + HALF + j).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1 = (x1 * r).to(dst.dtype.element_ty).to(tl.float32) * tl.load(w + j).to(tl.float32)
        x2 = (x2 * r).to(dst.dtype.element_ty).to(tl.float32) * tl.load(w + HALF + j).to(tl.float32)
        x1 = x1.to(dst.dtype.element_ty).to(tl.float32)
        x2 = x2.to(dst.dtype.element_ty).to(tl.float32)
    c = tl.load(cos + t * HALF + j).to(tl.float32)
    s = tl.load(sin + t * HALF + j).to(tl.float32)
    tl.store(dst + j, (x1 * c - x2 * s).to(dst.dtype.element_ty))
    tl.store(dst + HALF + j, (x2 * c + x1 * s).to(dst.dtype.element_ty))


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    T, HQ, D = q.shape
    HK = k.shape[1]
    q_out, k_out = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device), torch.empty(T, HK, D, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    norm = q_weight is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rope_kernel[(T, HQ + HK)](q, k, q_weight if norm else q, k_weight if norm else k, cos, sin, q_out, k_out,
                                       eps, q.stride(0), k.stride(0), HQ=HQ, HK=HK, HALF=D // 2, NORM=norm, num_warps=1)
    return q_out, k_out


def patch(llm):
    """Swap the fused model's products and q/k-norm + RoPE for the kernels above (before any graph exists)."""
    model = llm.model.model
    model.ops.qk_norm_rope = qk_norm_rope
    for layer in model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.forward = (lambda m: (lambda x: linear(x, m.weight)))(mod)


def run(patched: bool) -> dict:
    llm = LLM("qwen3-0.6b-random", max_model_len=4096)
    if patched:
        patch(llm)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    runner = llm.engine.runner
    out = {"bs1": [bench_batch1(llm)["tok_per_s"] for _ in range(3)]}
    prompt = list(range(100, 228))
    outs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1), use_tqdm=False)
    out["tokens"] = outs[0].outputs[0].token_ids
    out["replay_ms"] = {s: replay_ms(runner, s) for s in (1, 2, 8)}
    prof = replay_kernels(runner, 1)
    out["kernels_1"], out["kernel_us_1"], out["by_name_1"] = prof["kernels"], prof["kernel_us"], prof["by_name"][:14]
    # a batch of 32 greedy requests: batch > 1 keeps cuBLAS, so these should agree exactly with unpatched
    batch = [list(range(i, i + 40)) for i in range(32)]
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    out["batch_tokens"] = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    return out


def main() -> int:
    # the kernels against their references first
    torch.manual_seed(0)
    checks = {}
    for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        x, w = torch.randn(1, K, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float())
        checks[f"gemv_{N}x{K}_err_vs_fp32"] = (linear(x, w).float() - ref).abs().max().item()
        checks[f"cublas_{N}x{K}_err_vs_fp32"] = (torch.nn.functional.linear(x, w).float() - ref).abs().max().item()
    from nanoserve.model.qwen3_fused import qk_norm_rope as reference, rope_table
    for T in (1, 5, 300):
        qkv = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
        q, k = qkv[:, :2048].view(T, 16, 128), qkv[:, 2048:3072].view(T, 8, 128)
        qw, kw = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5, torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
        table = rope_table(4096, 128, 1e6, torch.bfloat16).cuda()
        cos, sin = table[torch.randint(0, 4096, (T,), device="cuda")].unbind(dim=1)
        for norm in (True, False):
            a, b = qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, cos, sin)
            ra, rb = reference(q, k, qw if norm else None, kw if norm else None, 1e-6, cos, sin)
            checks[f"qk_norm_rope_T{T}_norm{norm}_maxdiff"] = max((a.float() - ra.float()).abs().max().item(),
                                                                  (b.float() - rb.float()).abs().max().item())
    print(json.dumps(checks, indent=1), flush=True)
    result = {"checks": checks}
    for name, patched in (("cublas", False), ("patched", True), ("cublas_again", False), ("patched_again", True)):
        start = time.perf_counter()
        result[name] = run(patched)
        r = result[name]
        print(name, f"{time.perf_counter() - start:.0f}s", "bs1", [round(v) for v in r["bs1"]], "replay", r["replay_ms"],
              "kernels", r["kernels_1"], r["kernel_us_1"], flush=True)
    base, new = result["cublas"], result["patched"]
    same = next((i for i, (a, b) in enumerate(zip(base["tokens"], new["tokens"])) if a != b), None)
    result["bs1_first_divergence"] = same
    result["batch_same"] = sum(a == b for a, b in zip(base["batch_tokens"], new["batch_tokens"]))
    print("bs1 greedy first divergence at", same, "; batch-32 requests identical:", result["batch_same"], "of 32")
    for row in new["by_name_1"]:
        print("   ", row)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

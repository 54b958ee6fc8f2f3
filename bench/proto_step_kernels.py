"""Issue 24's per-step floor: lesson 06's two Triton kernels (a matrix-vector product for one-row linears, and
q/k-norm + RoPE in one kernel) against the same engine with them taken out (cuBLAS and torch.compile back in
before its graphs are recorded): the batch-1 speed, replay time, kernel count and agreement, in alternation,
in one process. GPU only. (The stored run, bench/results/issue24/proto_step_kernels_h200.json, patched a first
copy of the kernels in instead; that copy's tiles for the narrow products were slower.)

    python bench/proto_step_kernels.py OUT.json
"""
import functools
import json
import sys
import time

import torch

from nanoserve.bench import bench_batch1
from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.kernels.triton_fused import gemv, triton_qk_norm_rope
from nanoserve.model.qwen3_fused import _compile, qk_norm_rope as torch_qk_norm_rope, rope_table

sys.path.insert(0, "bench")
from gpu_step_floor import replay_kernels, replay_ms  # noqa: E402


def unfused_norm_linear(ops, x, residual, norm_weight, eps, linear):
    """FusedOps.norm_linear without its one-kernel path: the norm, then linear."""
    if residual is None:
        return linear(ops.rms_norm(x, norm_weight, eps)), x
    x, residual = ops.add_rms_norm(x, residual, norm_weight, eps)
    return linear(x), residual


def unfused_silu_linear(ops, gate_up, linear):
    """FusedOps.silu_linear without its one-kernel path."""
    return linear(ops.silu_and_mul(gate_up))


def without_kernels(llm):
    """The engine as it was before lesson 06's two Triton kernels (before any graph exists): its one-row
    products back on cuBLAS, q/k-norm + RoPE back on torch.compile."""
    model = llm.model.model
    model.ops.qk_norm_rope = _compile(torch_qk_norm_rope)
    # the norm and SiLU out of the products again: the two steps, through the products' forward below
    model.ops.norm_linear = functools.partial(unfused_norm_linear, model.ops)
    model.ops.silu_linear = functools.partial(unfused_silu_linear, model.ops)
    for layer in model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.forward = (lambda m: (lambda x: torch.nn.functional.linear(x, m.weight)))(mod)


def measure(llm, batch: int = 32, top: int = 14, out: dict | None = None) -> dict:
    """A warmed-up engine's batch-1 speed (3 runs), 64 greedy tokens at batch 1, replay times at 1, 2 and 8,
    the batch-1 replay's kernels (the `top` longest by name) and `batch` greedy requests' tokens; then it
    is shut down."""
    out = {} if out is None else out
    runner = llm.engine.runner
    out["bs1"] = [bench_batch1(llm)["tok_per_s"] for _ in range(3)]
    prompt = list(range(100, 228))
    outs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1), use_tqdm=False)
    out["tokens"] = outs[0].outputs[0].token_ids
    out["replay_ms"] = {s: replay_ms(runner, s) for s in (1, 2, 8)}
    prof = replay_kernels(runner, 1)
    out["kernels_1"], out["kernel_us_1"], out["by_name_1"] = prof["kernels"], prof["kernel_us"], prof["by_name"][:top]
    # greedy requests in a batch: their products stay on cuBLAS, but q/k-norm + RoPE is the kernel at every size
    outs = llm.generate([list(range(i, i + 40)) for i in range(batch)],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    out["batch_tokens"] = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    return out


def run(patched: bool) -> dict:
    llm = LLM("qwen3-0.6b-random", max_model_len=4096)
    if not patched:
        without_kernels(llm)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    return measure(llm)


def main() -> int:
    # the kernels against their references first
    torch.manual_seed(0)
    checks = {}
    for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        x, w = torch.randn(1, K, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float())
        checks[f"gemv_{N}x{K}_err_vs_fp32"] = (gemv(x, w).float() - ref).abs().max().item()
        checks[f"cublas_{N}x{K}_err_vs_fp32"] = (torch.nn.functional.linear(x, w).float() - ref).abs().max().item()
    for T in (1, 5, 300):
        qkv = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
        q, k = qkv[:, :2048].view(T, 16, 128), qkv[:, 2048:3072].view(T, 8, 128)
        qw, kw = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5, torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
        table = rope_table(4096, 128, 1e6, torch.bfloat16).cuda()
        cos, sin = table[torch.randint(0, 4096, (T,), device="cuda")].unbind(dim=1)
        for norm in (True, False):
            a, b = triton_qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, cos, sin)
            ra, rb = torch_qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, cos, sin)
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

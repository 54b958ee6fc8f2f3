"""Lesson 06's batch-1 kernels switched on and off inside one engine, in one process, in alternation: the
batch-1 speed, one graph replay's time and kernels (the longest by name), and the greedy tokens against the
engine without them. GPU only. Two comparisons:

  gemv       the one-row products on a Triton matrix-vector kernel and q/k-norm + RoPE in one kernel, against
             cuBLAS and torch.compile put back before the graphs are recorded (the kernels are first checked
             against float32 references)
  norm-silu  the norm and SiLU done inside the one-row products (norm_gemv, silu_gemv) against the two steps
             apart, and the norm alone inside

    python bench/batch1_kernels_on_off.py gemv OUT.json
    python bench/batch1_kernels_on_off.py norm-silu OUT.json

The stored runs (bench/results/latency/h200_gemv_qk_norm_on_off.json, h200_norm_silu_in_gemv_on_off.json) ran
earlier copies of the kernels: the first with four rows a program for the narrow products (slower tiles), the
second also launching the products with programmatic dependent launch (replays 0.02 ms shorter, batch 1 no
faster, so the kernels do without it).
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
from nanoserve.model import qwen3_fused
from nanoserve.model.qwen3_fused import _compile, qk_norm_rope as torch_qk_norm_rope, rope_table

sys.path.insert(0, "bench")
from step_floor import replay_kernels, replay_ms  # noqa: E402

FUSED = (qwen3_fused.FusedOps.norm_linear, qwen3_fused.FusedOps.silu_linear)


def unfused_norm_linear(ops, x, residual, norm, linear):
    """FusedOps.norm_linear without its one-kernel path: the norm, then linear."""
    if residual is None:
        return linear(ops.rms_norm(x, norm.weight, norm.eps)), x
    x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
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


def run_gemv(patched: bool) -> dict:
    llm = LLM("qwen3-0.6b-random", max_model_len=4096)
    if not patched:
        without_kernels(llm)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    return measure(llm)


def main_gemv(out_path: str) -> int:
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
        result[name] = run_gemv(patched)
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
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def run_norm_silu(fused: str) -> dict:
    """fused: "norm+silu", "norm" or "" (neither)."""
    qwen3_fused.FusedOps.norm_linear = FUSED[0] if "norm" in fused else unfused_norm_linear
    qwen3_fused.FusedOps.silu_linear = FUSED[1] if "silu" in fused else unfused_silu_linear
    start = time.perf_counter()
    llm = LLM("qwen3-0.6b-random", max_model_len=4096)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    out = {"start_s": time.perf_counter() - start}
    return measure(llm, batch=16, top=20, out=out)


def main_norm_silu(out_path: str) -> int:
    result = {"gpu": torch.cuda.get_device_name()}
    variants = {"neither": "", "norm+silu": "norm+silu", "norm": "norm"}
    for round_ in range(2):
        for name, fused in variants.items():
            key = f"{name}#{round_}"
            try:
                result[key] = r = run_norm_silu(fused)
            except Exception as e:  # a variant that cannot run says why, and the others still run
                result[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(key, result[key]["error"], flush=True)
                continue
            base = result.get(f"neither#{round_}", r)
            r["first_divergence"] = next((i for i, (a, b) in enumerate(zip(base["tokens"], r["tokens"])) if a != b), None)
            r["batch_same"] = sum(a == b for a, b in zip(base["batch_tokens"], r["batch_tokens"]))
            print(key, f"start {r['start_s']:.0f}s", "bs1", [round(v) for v in r["bs1"]], "replay",
                  {k: round(v, 3) for k, v in r["replay_ms"].items()}, "kernels", r["kernels_1"], r["kernel_us_1"],
                  "divergence", r["first_divergence"], "batch same", r["batch_same"], flush=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
    for key in ("neither#1", "norm+silu#1"):
        for row in result.get(key, {}).get("by_name_1", []):
            print(key, "   ", row)
    return 0



if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("gemv", "norm-silu"):
        sys.exit(__doc__)
    sys.exit((main_gemv if sys.argv[1] == "gemv" else main_norm_silu)(sys.argv[2]))

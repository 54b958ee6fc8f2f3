"""Issue 24's per-step floor, second step: the norm and SiLU done inside the one-row products (norm_gemv,
silu_gemv), each switched on and off in the same engine, in one process, in alternation: the batch-1 speed,
replay time, kernel count, the kernels by time, and the greedy tokens against the engine with neither.
GPU only. (bench/results/issue24/proto_prologue_pdl_h200.json is a run of a first version that also
launched the products with programmatic dependent launch: replays 0.02 ms shorter, batch 1 no faster,
so the kernels do without it.)

    python bench/proto_prologue.py OUT.json
"""
import json
import sys
import time

import torch

from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import qwen3_fused

sys.path.insert(0, "bench")
from proto_step_kernels import measure, unfused_norm_linear, unfused_silu_linear  # noqa: E402

FUSED = (qwen3_fused.FusedOps.norm_linear, qwen3_fused.FusedOps.silu_linear)


def run(fused: str) -> dict:
    """fused: "norm+silu", "norm" or "" (neither)."""
    qwen3_fused.FusedOps.norm_linear = FUSED[0] if "norm" in fused else unfused_norm_linear
    qwen3_fused.FusedOps.silu_linear = FUSED[1] if "silu" in fused else unfused_silu_linear
    start = time.perf_counter()
    llm = LLM("qwen3-0.6b-random", max_model_len=4096)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    out = {"start_s": time.perf_counter() - start}
    return measure(llm, batch=16, top=20, out=out)


def main() -> int:
    result = {"gpu": torch.cuda.get_device_name()}
    variants = {"neither": "", "norm+silu": "norm+silu", "norm": "norm"}
    for round_ in range(2):
        for name, fused in variants.items():
            key = f"{name}#{round_}"
            try:
                result[key] = r = run(fused)
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
            with open(sys.argv[1], "w") as f:
                json.dump(result, f, indent=1)
    for key in ("neither#1", "norm+silu#1"):
        for row in result.get(key, {}).get("by_name_1", []):
            print(key, "   ", row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

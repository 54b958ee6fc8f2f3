"""Where a batch-1 decode step's time goes on the GPU: the kernels one graph replay runs, the
replay time of each graph size, and the matrix products of Qwen3-0.6B's shapes at one row against eight,
through cuBLAS and through a Triton matrix-vector kernel. GPU only.

    python bench/step_floor.py OUT.json [--model qwen3-0.6b-random]
"""
import argparse
import collections
import json
import sys
import time

import torch
import triton

from nanoserve.bench import bench_batch1
from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.kernels.triton_fused import _gemv_kernel  # launched here with each tile of the sweep


def graph_time_ms(fn, reps: int = 50, rounds: int = 5) -> float:
    """Median ms of fn() replayed from a CUDA graph of `reps` calls (what it costs inside the engine's graph)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def gemv(x, w, out, block_n, block_k, num_warps):
    N, K = w.shape
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, out, N, K=K, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def matmuls(config) -> dict:
    c = config
    shapes = {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
              "o": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_up": (2 * c.intermediate_size, c.hidden_size),
              "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    out = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        row = {"N": N, "K": K, "bytes_MB": N * K * 2 / 1e6}
        for m in (1, 2, 4, 8):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            row[f"cublas_m{m}_ms"] = graph_time_ms(lambda: torch.nn.functional.linear(x, w))
        x, y = torch.randn(K, device="cuda", dtype=torch.bfloat16), torch.empty(N, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x[None], w)[0]
        best = None
        for block_n in (4, 8, 16, 32):
            for block_k in (128, 256, 512):
                for warps in (2, 4, 8):
                    if block_k > K:
                        continue
                    gemv(x, w, y, block_n, block_k, warps)
                    err = (y.float() - ref.float()).abs().max().item()
                    ms = graph_time_ms(lambda: gemv(x, w, y, block_n, block_k, warps), reps=20, rounds=3)
                    if best is None or ms < best[0]:
                        best = (ms, block_n, block_k, warps, err)
        row["triton_gemv_ms"], row["triton_cfg"] = best[0], best[1:4]
        row["triton_max_err"] = best[4]
        row["cublas_m1_TBps"] = N * K * 2 / row["cublas_m1_ms"] / 1e9
        row["triton_TBps"] = N * K * 2 / best[0] / 1e9
        out[name] = row
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return out


def replay_kernels(runner, size: int) -> dict:
    """The kernels one replay of graph `size` runs, by name: count and total GPU microseconds."""
    graph = runner.graphs.graphs[size][0]
    runner.builder.dev_views["slot_mapping"][:size].fill_(-1)  # replays write no K/V anywhere
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.device_time
    kernels = sorted(([n[:90], c, round(us, 1)] for n, (c, us) in by_name.items()), key=lambda r: -r[2])
    return {"kernels": sum(r[1] for r in kernels), "kernel_us": round(sum(r[2] for r in kernels), 1), "by_name": kernels}


def replay_ms(runner, size: int, replays: int = 200) -> float:
    graph = runner.graphs.graphs[size][0]
    runner.builder.dev_views["slot_mapping"][:size].fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--skip-matmuls", action="store_true")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name()}
    llm = LLM(args.model, max_model_len=4096)
    llm.generate(["warm-up"], SamplingParams(max_tokens=16), use_tqdm=False)
    runner = llm.engine.runner
    result["bs1"] = [bench_batch1(llm)["tok_per_s"] for _ in range(3)]
    print("bs1 tok/s", result["bs1"], flush=True)
    result["replay_ms"] = {s: replay_ms(runner, s) for s in runner.graphs.sizes[:6]}
    print("replay ms", result["replay_ms"], flush=True)
    result["profile_1"] = replay_kernels(runner, 1)
    result["profile_8"] = replay_kernels(runner, 8)
    for s in ("profile_1", "profile_8"):
        p = result[s]
        print(s, p["kernels"], "kernels", p["kernel_us"], "us of kernels", flush=True)
        for row in p["by_name"][:25]:
            print("   ", row)
    if not args.skip_matmuls:
        result["matmuls"] = matmuls(llm.model.config)
    llm.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

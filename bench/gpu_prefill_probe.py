"""Where do the workload's prefill steps go? Two workloads in one process (the second with every kernel
already compiled), then one 8,192-token prefill step under the profiler.

    python bench/gpu_prefill_probe.py --out FILE
"""
import argparse
import json
import random
import time

import torch

from nanoserve.bench import bench_nanoserve, workload
from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
result = {}
llm = LLM("qwen3-0.6b-random", max_model_len=4096)
llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
for seed in (0, 1):
    prompts, max_tokens = workload(seed=seed)
    result[f"workload_seed{seed}"] = bench_nanoserve(llm, prompts, max_tokens)
    print(result[f"workload_seed{seed}"], flush=True)
engine = llm.engine
rng = random.Random(5)
for rows in (16, 2):
    for _ in range(rows):
        engine.add_request([rng.randrange(10000) for _ in range(8192 // rows)], SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages()
    result[f"prefill_{rows}x{8192 // rows}"] = {
        "wall_ms": wall * 1000,
        "top_cpu": [(e.key[:70], e.self_cpu_time_total / 1000, e.count) for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[:15]],
        "top_gpu": [(e.key[:70], e.self_device_time_total / 1000, e.count) for e in sorted(table, key=lambda e: -e.self_device_time_total)[:15]]}
    print(json.dumps(result[f"prefill_{rows}x{8192 // rows}"], indent=1), flush=True)
    while engine.has_unfinished():
        engine.step()
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)

#!/usr/bin/env python3
"""Where a feature's time goes on a GPU: every one of 256 requests decoding together with one row of
`nanoserve bench --features`, its wall milliseconds per step (async scheduling, as served), then a
torch.profiler trace of a few steps (the top operators by CPU time and by GPU time) and cProfile's
(the Python functions by their own time).

    python bench/feature_profile.py --out OUT_DIR [--rows ROW ...] [--model M] [--num-seqs N] [--steps S]
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve import LLM
from nanoserve.bench import FEATURES, feature_params, workload


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(llm, prompts, params, steps: int, out_dir, row: str) -> dict:
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    try:
        while True:  # the prefills, until every sequence decodes
            tokens = [token for _, token in engine.step()]
            if not engine.scheduler.waiting and None not in tokens:
                break
        for _ in range(5):
            engine.step()
        sync()
        start, running = time.perf_counter(), []
        for _ in range(steps):
            running.append(len(engine.step()))
        sync()
        wall = (time.perf_counter() - start) / steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            sync()
        table = prof.key_averages()
        by_cpu = table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
        by_gpu = table.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60)
        python = cProfile.Profile()  # the Python around the operators
        python.runcall(lambda: [engine.step() for _ in range(8)])
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(16)
        with open(f"{out_dir}/{row.replace(' ', '_').replace('=', '')}.txt", "w") as f:
            f.write(by_cpu + "\n\n" + by_gpu + "\n\n" + text.getvalue())
        return {"ms_per_step": 1000 * wall, "mean_batch": sum(running) / len(running)}
    finally:
        for seq in seqs:
            engine.scheduler.abort(seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", nargs="*", default=[r for r in FEATURES if r != "mixed"])
    ap.add_argument("--model", default="qwen3-0.6b-random")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    prompts, _ = workload(args.num_seqs)
    prompts = [p[:200] for p in prompts]  # short prompts: the steps measured are decodes
    found = {}
    with LLM(args.model, max_model_len=4096) as llm:
        for row in args.rows:
            params = feature_params(row, [1000] * len(prompts), 1000)
            decode_steps(llm, prompts[:8], params[:8], 3, args.out, "warm")
            found[row] = decode_steps(llm, prompts, params, args.steps, args.out, row)
            print(row, found[row], flush=True)
    with open(f"{args.out}/feature_profile.json", "w") as f:
        json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()

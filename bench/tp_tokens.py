"""Greedy tokens of one engine, written as JSON: one engine per process, so that a hang or a crash in one
configuration cannot stop the others (bench/tensor_parallel.py's parity phase runs this under a time limit).

    python bench/tp_tokens.py MODEL TP DTYPE OUT.json [--tight] [--eager] [--limit SECONDS]

The requests: 24 random prompts of 1..300 tokens, every other one behind a shared 40-token prefix
(prefix-cache hits), 32 greedy tokens each. --tight: a small pool and token budget, so that chunked
prefill and preemption happen. On a hang, every thread's stack is printed (faulthandler) and it exits.
"""
import argparse
import faulthandler
import json
import time

import torch

from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams


def requests(num=24):
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 10000, (40,), generator=gen).tolist()  # shared: prefix caching hits
    prompts = [(prefix if i % 2 else []) + torch.randint(0, 10000, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(1, 300, (num,), generator=gen))]
    return prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("tp", type=int)
    parser.add_argument("dtype")
    parser.add_argument("out")
    parser.add_argument("--tight", action="store_true")
    parser.add_argument("--limit", type=float, default=240)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no CUDA graphs, no compiled ops")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.limit, exit=True)
    pool = dict(max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks_override=120) if args.tight else {}
    if args.eager:
        pool["enforce_eager"] = True
    start = time.perf_counter()
    prompts, params = requests()
    with LLM(args.model, dtype=args.dtype, max_model_len=1024, tensor_parallel_size=args.tp, **pool) as llm:
        built = time.perf_counter() - start
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats
    with open(args.out, "w") as f:
        json.dump({"tokens": out, "build_s": built, "seconds": time.perf_counter() - start,
                   "preemptions": stats.preemptions}, f)
    print(f"{args.model} TP={args.tp} {args.dtype}: built in {built:.1f} s, done in {time.perf_counter() - start:.1f} s,"
          f" {stats.preemptions} preemptions", flush=True)

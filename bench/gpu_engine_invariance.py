"""On a GPU in float32: the engine (Triton kernels, a tiny KV pool that forces preemption, chunked
prefill) gives every request the same tokens as when it runs alone, with and without prefix caching.

Run on a CUDA machine:  python bench/gpu_engine_invariance.py
"""
import random

import torch

from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams

rng = random.Random(0)
prompts = [[rng.randrange(5000) for _ in range(rng.randint(1, 60))] for _ in range(24)]
params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(1, 20), ignore_eos=True)
          for i in range(24)]
for caching in (False, True):
    big = LLM("tiny-qwen3", dtype=torch.float32, max_model_len=256, num_gpu_blocks_override=512,
              enable_prefix_caching=caching)
    alone = [big.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    small = LLM("tiny-qwen3", dtype=torch.float32, max_model_len=256, num_gpu_blocks_override=24,
                max_num_batched_tokens=32, max_num_seqs=12, enable_prefix_caching=caching)
    batched = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    stats = small.engine.stats
    print(f"H200 fp32, Triton kernels, prefix caching {caching}: all 24 equal alone vs batched: {alone == batched}; "
          f"preemptions {stats.preemptions}, steps {stats.steps}")

"""On a GPU in float32: lesson 03's paged cache with the Triton kernels gives exactly lesson 02's greedy tokens.

Run on a CUDA machine:  python bench/gpu_paged_fp32_parity.py
(In bf16 the two paths may part after a few tokens: random weights give near-tied logits, and the
kernels add up in another order. In fp32 they must agree token for token.)
"""
import torch

from nanoserve.course.generate import generate
from nanoserve.model.loader import load_model
from nanoserve.cache.paged import PagedKVCache
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.zoo import resolve_model

m = load_model(resolve_model("qwen3-0.6b-random"), dtype=torch.float32, device="cuda")
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (15, 16, 17, 64, 100)]
sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
a = [c.token_ids for c in generate(m, prompts, sp)[0]]
cache = PagedKVCache(m.config, num_blocks=256, block_size=16, dtype=torch.float32, device="cuda")
b = [c.token_ids for c in generate(m, prompts, sp, cache=cache)[0]]
print("fp32 on H200, paged+Triton vs contiguous, tokens equal per prompt:", [x == y for x, y in zip(a, b)])

"""bf16 parity of the engine with transformers on a GPU, for the Qwen3-0.6B shape (random weights).

Run on a CUDA machine:  python bench/bf16_parity.py [--out results.json]
Prints and saves: logit agreement with transformers' Qwen3ForCausalLM (sdpa), how many greedy tokens
agree (naive forward, KV-cache generate, transformers' cached generate), and eager decode speed.
"""
import argparse
import json
import time

import torch
import transformers

from nanoserve.course.no_cache import NoCache
from nanoserve.course.generate import generate
from nanoserve.model.loader import load_model
from nanoserve.course.naive import naive_generate
from nanoserve.cache.paged import PagedKVCache
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.zoo import resolve_model


def agree(a, b):
    """Length of the common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this script needs a CUDA GPU"
    path = resolve_model("qwen3-0.6b-random")
    ours = load_model(path, dtype=torch.bfloat16, device="cuda")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 10000, (64,), generator=gen).tolist()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__}

    with torch.inference_mode():
        ids = torch.tensor(prompt, device="cuda")
        mine = ours.compute_logits(ours(ids, torch.arange(len(prompt), device="cuda"), NoCache())).float()
        theirs = hf(ids[None]).logits[0].float()
    result["logits_max_abs_diff"] = (mine - theirs).abs().max().item()
    result["logits_cosine_min"] = torch.nn.functional.cosine_similarity(mine, theirs, dim=-1).min().item()
    result["argmax_agreement"] = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()

    steps = 32
    naive = naive_generate(ours, prompt, steps)
    cached = generate(ours, [prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0][0].token_ids
    with torch.inference_mode():
        hf_out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps, do_sample=False,
                             min_new_tokens=steps, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    result["greedy_common_prefix"] = {"naive_vs_cached": agree(naive, cached), "cached_vs_transformers": agree(cached, hf_out),
                                      "of": steps}

    # Lesson 03: the same greedy tokens through the paged cache and the Triton kernels, for a batch of
    # prompts whose lengths sit on and around block boundaries.
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (15, 16, 17, 64, 100)]
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    contiguous = [c.token_ids for c in generate(ours, prompts, sp)[0]]
    paged_cache = PagedKVCache(ours.config, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cuda")
    paged = [c.token_ids for c in generate(ours, prompts, sp, cache=paged_cache)[0]]
    result["paged_triton_vs_contiguous_common_prefix"] = [agree(a, b) for a, b in zip(paged, contiguous)]
    result["paged_blocks_returned"] = paged_cache.block_manager.num_free == 256

    # Eager decode speed of lessons 02 and 03's static batch, for the record (lesson 06 adds CUDA graphs).
    for batch in (1, 16):
        prompts = [torch.randint(0, 10000, (128,), generator=gen).tolist() for _ in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        generate(ours, prompts, sp)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        completions, _ = generate(ours, prompts, sp)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        result[f"eager_static_batch{batch}_tok_per_s"] = sum(len(c.token_ids) for c in completions) / seconds
        cache = PagedKVCache(ours.config, num_blocks=2048, block_size=16, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        completions, _ = generate(ours, prompts, sp, cache=cache)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        result[f"eager_paged_batch{batch}_tok_per_s"] = sum(len(c.token_ids) for c in completions) / seconds
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

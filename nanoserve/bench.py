"""`nanoserve bench`: the course's benchmark workload through our engine and through transformers.

The workload is nano-vllm's bench: random.seed(0); 256 requests; prompts of randint(100, 1024) random
token ids in [0, 10000); max_tokens randint(100, 1024); temperature 0.6; ignore_eos; max_model_len 4096;
one warm-up call; throughput = output tokens / wall time.
"""
import dataclasses
import json
import random
import sys
import time

import torch


def workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0):
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def bench_nanoserve(model: str, prompts, max_tokens, max_model_len: int = 4096) -> dict:
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    llm = LLM(model, max_model_len=max_model_len)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up (kernel compiles)
    before = dataclasses.replace(llm.engine.stats)  # the counters before the timed call
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats
    steps, prefill_steps = stats.steps - before.steps, stats.prefill_steps - before.prefill_steps
    pool = llm.cache.block_manager
    return {"engine": "nanoserve (eager)", "seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds,
            "prefill_steps": prefill_steps, "decode_only_steps": steps - prefill_steps,
            "preemptions": stats.preemptions - before.preemptions, "kv_blocks": pool.num_blocks,
            "block_size": pool.block_size}


def bench_transformers(model: str, prompts, max_tokens) -> dict:
    """transformers' batched generate: left-padded, every request runs to the longest max_tokens; only
    each request's own max_tokens count as useful output."""
    import transformers

    from nanoserve.model.zoo import resolve_model

    path = resolve_model(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    kwargs = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(ids[:1, -16:].cuda(), attention_mask=mask[:1, -16:].cuda(), max_new_tokens=8, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(max_tokens),
                    min_new_tokens=max(max_tokens), **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    useful = sum(max_tokens)
    return {"engine": f"transformers {transformers.__version__} batched generate (sdpa, left-padded)",
            "seconds": seconds, "output_tokens": useful, "tok_per_s": useful / seconds}


def main(model: str, baseline: bool, out: str | None, num_seqs: int) -> int:
    if not torch.cuda.is_available() and num_seqs == 256:
        print("nanoserve: bench measures a GPU; on a CPU the full workload would take hours "
              "(try --num-seqs 4 --no-baseline --model tiny-qwen3 to see it run)", file=sys.stderr)
        return 2
    prompts, max_tokens = workload(num_seqs)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens", file=sys.stderr)
    results = {"model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "nanoserve": bench_nanoserve(model, prompts, max_tokens)}
    ours = results["nanoserve"]
    print(f"nanoserve: {ours['output_tokens']:,} tokens in {ours['seconds']:.1f} s = {ours['tok_per_s']:,.0f} tok/s "
          f"({ours['prefill_steps']} steps with prefill, {ours['decode_only_steps']} decode-only, "
          f"{ours['preemptions']} preemptions; KV pool {ours['kv_blocks']:,} blocks of {ours['block_size']})")
    if baseline:
        if not torch.cuda.is_available():
            print("nanoserve: the transformers baseline needs a GPU; skipped", file=sys.stderr)
        else:
            theirs = results["transformers"] = bench_transformers(model, prompts, max_tokens)
            results["speedup"] = ours["tok_per_s"] / theirs["tok_per_s"]
            print(f"{theirs['engine']}: {theirs['tok_per_s']:,.0f} useful tok/s ({theirs['seconds']:.1f} s); "
                  f"nanoserve is {results['speedup']:.2f}x")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0

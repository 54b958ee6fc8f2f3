"""Issue 24's correctness point, on a GPU in float32: every fast path gives the eager engine's tokens.

The reference is the eager engine (enforce_eager=True: no CUDA graphs, no torch.compile, no async scheduling,
lesson 05's sampler) running each request alone in a roomy pool. Against it, the engine as LLM(model) builds
it on a GPU (graphs, compiled fused ops, the fused sampler, async scheduling) runs the same requests
(a) alone and (b) all at once in a tight pool with small steps, so that preemption, chunked prefill and
prefix hits happen. Requests mix greedy, seeded sampling (top-k, top-p, min-p), n=2 and logprobs=3.

    python bench/gpu_fast_paths_fp32.py OUT.json [--models tiny-qwen3 qwen3-0.6b-random]   (GPU only)
"""
import argparse
import json
import random

import torch

from nanoserve import LLM, SamplingParams


def workload(seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 5000) for _ in range(40)]  # a common prefix: prefix-cache hits
    prompts, params = [], []
    for i in range(24):
        own = [rng.randrange(1, 5000) for _ in range(rng.randint(1, 60))]
        prompts.append(shared[:rng.randint(17, 40)] + own if i % 3 == 0 else own)
        kind = i % 6
        kw = dict(max_tokens=rng.randint(1, 24), ignore_eos=True, seed=i)
        kw.update([dict(temperature=0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9),
                   dict(temperature=0.7, n=2), dict(temperature=0, logprobs=3),
                   dict(temperature=1.1, min_p=0.05, logprobs=2)][kind])
        params.append(SamplingParams(**kw))
    return prompts, params


def completions(outputs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


def compare(reference, candidate):
    """(requests whose every completion has the reference's tokens, largest log-prob difference)."""
    same, worst = 0, 0.0
    for ref, cand in zip(reference, candidate):
        same += [t for t, _ in ref] == [t for t, _ in cand]
        for (_, ref_lp), (_, cand_lp) in zip(ref, cand):
            for a, b in zip(ref_lp or [], cand_lp or []):
                for token in set(a) & set(b):
                    worst = max(worst, abs(float(a[token]) - float(b[token])))
    return same, worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3", "qwen3-0.6b-random"])
    args = parser.parse_args()
    prompts, params = workload()
    results = {}
    for model in args.models:
        common = dict(dtype=torch.float32, max_model_len=512)
        with LLM(model, enforce_eager=True, num_gpu_blocks_override=1024, **common) as eager:
            reference = [completions(eager.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
        with LLM(model, num_gpu_blocks_override=1024, **common) as fast:
            engine = fast.engine
            paths = {"graphs": engine.runner.graphs is not None, "async": engine.async_scheduling,
                     "compiled": not fast.enforce_eager}
            alone = [completions(fast.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
        with LLM(model, num_gpu_blocks_override=12, max_num_batched_tokens=48, max_num_seqs=12, **common) as tight:
            outputs = tight.generate(prompts, params, use_tqdm=False)
            batched, stats = completions(outputs), tight.engine.stats
            pressure = {"preemptions": stats.preemptions, "steps": stats.steps, "prefill_steps": stats.prefill_steps,
                        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs)}
        same_alone, lp_alone = compare(reference, alone)
        same_batched, lp_batched = compare(reference, batched)
        results[model] = {"fast_paths": paths, "requests": len(prompts), "alone_same_as_eager": same_alone,
                          "batched_same_as_eager": same_batched, "max_logprob_diff_alone": lp_alone,
                          "max_logprob_diff_batched": lp_batched, **pressure}
        print(model, json.dumps(results[model]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "dtype": "float32", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

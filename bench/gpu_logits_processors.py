"""H200: vLLM's logits-editing sampling parameters on the GPU's path: CUDA graphs, async scheduling
(placeholders resolved on the device) and lesson 06's compiled sampler.

fp32: each edited request's tokens are the same alone, in a batch with 40 plain requests (graphs at larger
sizes), and in an eager engine without async scheduling; the constraints hold; async scheduling still runs
steps ahead with edited requests in the batch. bf16: the constraints hold (allowed ids, bad words, a forced
token, min_tokens).

    python bench/gpu_logits_processors.py OUT.json
"""
import json
import os
import random
import sys
import time

from nanoserve import LLM, SamplingParams

MODEL = os.environ.get("NANOSERVE_MODEL", "qwen3-0.6b-random")
EDITING = [dict(repetition_penalty=1.8), dict(frequency_penalty=2.0, temperature=1.0),
           dict(presence_penalty=-1.0, temperature=0.9), dict(min_p=0.2, temperature=1.2),
           dict(logit_bias={17: 100.0}, temperature=0.8), dict(allowed_token_ids=[11, 12, 13], temperature=1.0),
           dict(bad_words=["hello world", "the"]), dict(min_tokens=20, max_tokens=40)]


def case_params(i, kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 32), seed=i, **kw)


def main(out_path: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50000) for _ in range(rng.randint(4, 40))] for _ in EDITING]
    params = [case_params(i, dict(kw)) for i, kw in enumerate(EDITING)]
    plain_prompts = [[rng.randrange(1, 50000) for _ in range(rng.randint(4, 40))] for _ in range(40)]
    plain_params = [SamplingParams(max_tokens=32, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(40)]
    results = {}

    def run(llm, ps, sps):
        return [o.outputs[0].token_ids for o in llm.generate(ps, sps, use_tqdm=False)]

    graphs = LLM(MODEL, dtype="float32", max_model_len=1024)
    engine = graphs.engine
    alone = [run(graphs, [p], [sp])[0] for p, sp in zip(prompts, params)]
    before = (engine.stats.steps, engine.stats.steps_ahead)
    start = time.perf_counter()
    mixed = run(graphs, prompts + plain_prompts, params + plain_params)
    results["mixed_s"] = time.perf_counter() - start
    steps, ahead = engine.stats.steps - before[0], engine.stats.steps_ahead - before[1]
    results["mixed_steps"], results["mixed_steps_ahead"] = steps, ahead
    start = time.perf_counter()
    plain_only = run(graphs, plain_prompts, plain_params)
    results["plain_only_s"] = time.perf_counter() - start
    results["plain_same_with_edited_batch_mates"] = plain_only == mixed[len(prompts):]
    results["fp32_alone_equals_mixed_batch"] = [a == m for a, m in zip(alone, mixed[:len(prompts)])]
    results["async_scheduling"], results["graphs"] = engine.async_scheduling, engine.runner.graphs is not None
    del engine  # (a reference kept here would keep the KV pool alive after shutdown)
    graphs.shutdown()
    eager = LLM(MODEL, dtype="float32", max_model_len=1024, enforce_eager=True)
    results["fp32_alone_equals_eager_sync"] = [a == e for a, e in zip(alone, run(eager, prompts, params))]
    # the control: plain requests, eager against graphs + torch.compile (the two models' own fp32 rounding)
    results["fp32_plain_graphs_equal_eager"] = plain_only == run(eager, plain_prompts, plain_params)
    eager.shutdown()

    bf16 = LLM(MODEL, max_model_len=1024)
    tok = bf16.tokenizer
    outs = bf16.generate(prompts, params, use_tqdm=False)
    results["bf16_errors"] = [o.error for o in outs if o.error]
    ids = [o.outputs[0].token_ids for o in outs]
    results["bf16_lengths"] = [len(t) for t in ids]
    banned = [tok.encode(w, add_special_tokens=False) for w in ("hello world", "the", " hello world", " the")]
    results["bf16_allowed_only"] = all(t in (11, 12, 13) for t in ids[5])
    results["bf16_forced_token"] = ids[4].count(17) == len(ids[4])
    results["bf16_no_bad_words"] = not any(ids[6][i:i + len(w)] == w for w in banned for i in range(len(ids[6])))
    eos = min(bf16.eos_token_ids)
    forced_eos = bf16.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, min_tokens=7,
                                                            logit_bias={eos: 100.0}), use_tqdm=False)[0].outputs[0]
    results["bf16_min_tokens"] = (len(forced_eos.token_ids), forced_eos.finish_reason, forced_eos.token_ids[-1:],
                                  sorted(bf16.eos_token_ids))
    failed = bf16.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, min_tokens=7,
                                                        logit_bias={eos: 100.0}), use_tqdm=False)[0]
    results["bf16_min_tokens_error"] = failed.error
    bf16.shutdown()
    print(json.dumps(results, indent=1))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

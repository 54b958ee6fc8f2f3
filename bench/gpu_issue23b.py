"""H200: prompt_logprobs and structured outputs on the GPU's path (issue 23): CUDA graphs, async scheduling,
the compiled sampler, a warm prefix cache.

fp32: prompt_logprobs from the default engine (graphs, async, prefix caching warm) against an eager engine
without async scheduling or prefix caching (the largest difference of the prompt tokens' log-probs, and
whether the top-k ids agree); each structured request's tokens alone against in a batch with 40 plain
requests. bf16: every structured output follows its constraint.

    python bench/gpu_logits_processorsb.py OUT.json
"""
import json
import os
import random
import re
import sys
import time

from nanoserve import LLM, SamplingParams, StructuredOutputsParams

MODEL = os.environ.get("NANOSERVE_MODEL", "qwen3-0.6b-random")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "b", "c"]}, "name": {"type": "string", "maxLength": 8}},
          "required": ["id", "tag", "name"], "additionalProperties": False}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return set(value) == {"id", "tag", "name"} and isinstance(value["id"], int) and 0 <= value["id"] <= 999 \
            and value["tag"] in "abc" and isinstance(value["name"], str) and len(value["name"]) <= 8
    if kind == "regex":
        return re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text) is not None
    return text in ("alpha", "beta", "gamma")


CONSTRAINTS = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"),
               "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma"])}


def structured(llm, rng, results, key):
    kinds = list(CONSTRAINTS) * 4
    prompts = [[rng.randrange(1, 50000) for _ in range(rng.randint(4, 60))] for _ in kinds]
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_outputs=CONSTRAINTS[k])
              for i, k in enumerate(kinds)]
    plain = [[rng.randrange(1, 50000) for _ in range(rng.randint(4, 60))] for _ in range(40)]
    plain_params = [SamplingParams(max_tokens=48, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(40)]
    start = time.perf_counter()
    mixed = llm.generate(prompts + plain, params + plain_params, use_tqdm=False)
    results[f"{key}_mixed_s"] = time.perf_counter() - start
    results[f"{key}_valid"] = [valid(k, o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
                               for k, o in zip(kinds, mixed)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts[:6], params[:6])]
    results[f"{key}_alone_equals_mixed"] = [a == m.outputs[0].token_ids for a, m in zip(alone, mixed)]
    results[f"{key}_examples"] = [o.outputs[0].text for o in mixed[:6]]


def main(out_path: str) -> None:
    rng = random.Random(0)
    results = {"model": MODEL}
    prompts = [[rng.randrange(1, 50000) for _ in range(n)] for n in (3, 40, 200, 700, 1500, 2100)]
    scoring = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5)
    fast = LLM(MODEL, dtype="float32", max_model_len=4096, max_num_batched_tokens=2048)  # 2100: in chunks
    fast.generate([p[:len(p) // 2 + 1] for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)  # warm cache
    got = fast.generate(prompts, scoring, use_tqdm=False)
    results["fast_engine"] = {"graphs": fast.engine.runner.graphs is not None, "async": fast.engine.async_scheduling,
                              "prefix_caching": type(fast.cache).__name__}
    results["num_cached_tokens"] = [o.num_cached_tokens for o in got]
    structured(fast, rng, results, "fp32")
    fast.shutdown()
    eager = LLM(MODEL, dtype="float32", max_model_len=4096, enforce_eager=True, async_scheduling=False,
                enable_prefix_caching=False)
    want = eager.generate(prompts, scoring, use_tqdm=False)
    eager.shutdown()
    worst, same_top = 0.0, []
    for p, a, b in zip(prompts, got, want):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            worst = max(worst, abs(a.prompt_logprobs[j][p[j]] - b.prompt_logprobs[j][p[j]]))
            same_top.append(list(a.prompt_logprobs[j])[:5] == list(b.prompt_logprobs[j])[:5])
    results["fp32_prompt_logprob_max_abs_diff"] = worst
    results["fp32_prompt_top5_same_fraction"] = sum(same_top) / len(same_top)
    results["fp32_outputs_same"] = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, want)]
    bf16 = LLM(MODEL, max_model_len=4096)
    structured(bf16, rng, results, "bf16")
    bf16.shutdown()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

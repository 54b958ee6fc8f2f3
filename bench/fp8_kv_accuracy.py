"""Issue 24's fp8 KV cache, before any kernel reads it: what e4m3 K/V would cost in accuracy, on a CPU,
with SmolLM2-135M's real weights in float32. Each layer's new K and V are rounded to float8 e4m3 (with a
scale) and back before the cache stores them, which is exactly what a cache holding e4m3 and kernels that
dequantise on reading would compute; bfloat16 K/V (the GPU engine's cache) is measured the same way, as
the reference point. 64 prompts, greedy, 32 new tokens each; against the float32 cache: the continuations
that stay identical, and the largest error in the first step's logits.

    python bench/fp8_kv_accuracy.py [--out bench/results/issue24/fp8_kv_cpu.json]

Scales: "1.0" (vLLM's default without calibration), and per layer from a calibration run on the same
prompts ("calibrated": max |K| and max |V| of each layer / 448, e4m3's largest value).
"""
import argparse
import json

import torch

from nanoserve import LLM, SamplingParams

TOPICS = ["the ocean", "volcanoes", "the Roman empire", "bread", "jazz", "electric cars", "honeybees", "chess",
          "the moon", "coffee", "glaciers", "the printing press", "tigers", "rainforests", "bicycles", "opera",
          "the internet", "deserts", "penguins", "tea", "the Great Wall", "vaccines", "owls", "football",
          "the Nile", "photography", "earthquakes", "chocolate", "submarines", "the violin", "mushrooms", "kites",
          "the Sahara", "robots", "whales", "origami", "lightning", "castles", "the piano", "rice", "comets",
          "dolphins", "the Eiffel Tower", "bamboo", "trains", "the Olympics", "honey", "snow", "maps", "clocks",
          "Mars", "cheese", "lighthouses", "elephants", "the alphabet", "sunflowers", "bridges", "sharks",
          "pyramids", "wind turbines", "libraries", "coral reefs", "the compass", "butterflies"]


def quantizing(attend, scales=None, record=None, dtype=torch.float8_e4m3fn):
    """cache.attend with each layer's new K and V rounded to `dtype` (times a scale) and back; record: also
    note each layer's largest |K| and |V|."""
    def attend_rounded(layer_idx, q, k, v, meta):
        if record is not None:
            seen = record.setdefault(layer_idx, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], k.abs().max().item()), max(seen[1], v.abs().max().item())
        if scales is not None or dtype is torch.bfloat16:
            sk, sv = scales[layer_idx] if scales is not None else (1.0, 1.0)
            k = (k / sk).to(dtype).to(k.dtype) * sk
            v = (v / sv).to(dtype).to(v.dtype) * sv
        return attend(layer_idx, q, k, v, meta)
    return attend_rounded


def run(llm, prompts, attend):
    cache = llm.engine.cache
    cache.attend, original = attend, cache.attend
    try:
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        first = SamplingParams(temperature=0, max_tokens=1, logprobs=20)  # the 20 best log-probs of step 1
        logprobs = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, first, use_tqdm=False)]
    finally:
        cache.attend = original
    return tokens, logprobs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/issue24/fp8_kv_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=64, enable_prefix_caching=False)
    prompts = [f"Here is a short paragraph about {topic}:" for topic in TOPICS]
    amax = {}
    ref_tokens, ref_lp = run(llm, prompts, quantizing(llm.engine.cache.attend, record=amax))
    calibrated = {layer: (k / 448, v / 448) for layer, (k, v) in amax.items()}
    ones = dict.fromkeys(amax, (1.0, 1.0))
    result = {"model": "smollm2-135m-instruct", "device": "cpu", "dtype": "float32", "prompts": len(prompts),
              "new_tokens": 32, "max_abs_k_v_per_layer": amax}
    variants = {"bf16": quantizing(llm.engine.cache.attend, dtype=torch.bfloat16),
                "fp8 e4m3, scale 1.0": quantizing(llm.engine.cache.attend, ones),
                "fp8 e4m3, calibrated per layer": quantizing(llm.engine.cache.attend, calibrated)}
    for name, attend in variants.items():
        tokens, lp = run(llm, prompts, attend)
        same = sum(a == b for a, b in zip(tokens, ref_tokens))
        agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens, ref_tokens)]
        # the error of the log-probs both runs list (their top 20 at the first step)
        err = max(abs(d[t].logprob - r[t].logprob) for d, r in zip(lp, ref_lp) for t in d.keys() & r.keys())
        result[name] = {"identical_continuations": same, "of": len(prompts),
                        "mean_tokens_before_first_difference": sum(agree) / len(agree),
                        "max_first_step_logprob_error": err}
        print(name, result[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

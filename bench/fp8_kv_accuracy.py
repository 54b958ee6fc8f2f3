"""The fp8 KV cache: what it costs in accuracy, on a CPU through the kernels' torch twins, with
SmolLM2-135M's real weights in float32. Three engines that differ only in kv_cache_dtype: "auto" (float32
K/V), "bfloat16" (the GPU engine's cache) and "fp8" (e4m3, scale 1.0: the cache stores each K/V value
clamped to +-448 and rounded to e4m3, and the kernels widen it as they read). 64 prompts, greedy, 32 new
tokens each: the continuations that stay identical, and the largest error in the first step's log-probs.

    python bench/fp8_kv_accuracy.py [--out bench/results/accuracy/cpu_fp8_kv.json]
    python bench/fp8_kv_accuracy.py --device cuda --out bench/results/accuracy/h200_fp8_kv.json     (the Triton kernels: the
        model in float32 as above, then in bfloat16 with bf16 K/V against fp8 K/V)

Scales: 1.0 (vLLM's default without calibration). SmolLM2's K and V stay under 24 and 17 in size here, well
inside e4m3's range (448), so a scale would only move values within the range; e4m3's error is its 3-bit
mantissa, which a scale does not change (an earlier per-layer calibrated run did no better: 19 of 64
identical against 23).
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


def run(kv_cache_dtype: str, prompts: list[str], device: str = "cpu", dtype: str = "float32"):
    with LLM("smollm2-135m-instruct", device=device, dtype=dtype, max_num_seqs=64, enable_prefix_caching=False,
             kv_cache_dtype=kv_cache_dtype) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        first = SamplingParams(temperature=0, max_tokens=1, logprobs=20)  # the 20 best log-probs of step 1
        logprobs = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, first, use_tqdm=False)]
    return tokens, logprobs


def compare(tokens, lp, ref_tokens, ref_lp) -> dict:
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens, ref_tokens)]
    # the error of the log-probs both runs list (their top 20 at the first step)
    err = max(abs(d[t].logprob - r[t].logprob) for d, r in zip(lp, ref_lp) for t in d.keys() & r.keys())
    return {"identical_continuations": sum(a == b for a, b in zip(tokens, ref_tokens)), "of": len(tokens),
            "mean_tokens_before_first_difference": sum(agree) / len(agree), "max_first_step_logprob_error": err}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/accuracy/cpu_fp8_kv.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = [f"Here is a short paragraph about {topic}:" for topic in TOPICS]
    runs = {name: run(name, prompts, args.device) for name in ("auto", "bfloat16", "fp8")}
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name()
    result = {"model": "smollm2-135m-instruct", "device": device, "dtype": "float32", "prompts": len(prompts),
              "new_tokens": 32, "fp8 scale": 1.0,
              "bf16 KV against float32 KV": compare(*runs["bfloat16"], *runs["auto"]),
              "fp8 KV against bf16 KV": compare(*runs["fp8"], *runs["bfloat16"]),
              "fp8 KV against float32 KV": compare(*runs["fp8"], *runs["auto"])}
    if args.device != "cpu":  # the GPU engine's own setting: a bf16 model, its K/V in bf16 or in fp8
        bf16 = {name: run(name, prompts, args.device, "bfloat16") for name in ("auto", "fp8")}
        result["bf16 model: fp8 KV against bf16 KV"] = compare(*bf16["fp8"], *bf16["auto"])
    for name, found in result.items():
        print(name, found, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

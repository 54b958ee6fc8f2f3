"""On a CPU: our engine against transformers' generate, SmolLM2-135M in float32, batch 1 and 16, in one run.

    python bench/cpu_vs_transformers.py [--out FILE]
"""
import argparse
import json
import time

import torch
import transformers

from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.zoo import resolve_model

MODEL = "smollm2-135m-instruct"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llm-args", default="{}", help="LLM keyword arguments, as JSON")
    args = parser.parse_args()
    path = resolve_model(MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    result = {"model": MODEL, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__}
    llm = LLM(MODEL, device="cpu", max_num_seqs=64, **json.loads(args.llm_args))
    gen = torch.Generator().manual_seed(0)
    for batch in args.batches:
        ids = torch.randint(100, 10000, (batch, args.prompt_len), generator=gen)
        sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(ids[:, :8].tolist(), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        with torch.inference_mode():
            hf.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        ours = theirs = float("inf")
        for _ in range(args.repeats):  # taking turns, best of each: a busy moment of the machine hits both
            start = time.perf_counter()
            outs = llm.generate(ids.tolist(), sp, use_tqdm=False)
            ours = min(ours, time.perf_counter() - start)
            with torch.inference_mode():
                start = time.perf_counter()
                theirs_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                         min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                                         eos_token_id=None)
                theirs = min(theirs, time.perf_counter() - start)
        same = sum(o.outputs[0].token_ids == t[args.prompt_len:].tolist() for o, t in zip(outs, theirs_ids))
        tokens = batch * args.new_tokens
        result[f"batch{batch}"] = {"nanoserve_tok_per_s": tokens / ours, "transformers_tok_per_s": tokens / theirs,
                                   "ratio": theirs / ours, "same_greedy_tokens": f"{same}/{batch}"}
        print(batch, json.dumps(result[f"batch{batch}"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""H200: issue 39's engine changes on the GPU's path (CUDA graphs, async scheduling, the compiled sampler).

- prompt_logprobs scored 256 rows at a time (the default) and 3 rows at a time give the same ranks and tokens;
- structured outputs (compiled with their first mask before admission) follow their constraint in a batch of
  plain requests, and a plain request's greedy tokens are the same alone and beside them;
- constraints that leave no token end their own request with an error; token ids beyond the vocabulary are
  refused with .param naming the field.

    python bench/gpu_request_safety.py OUT.json      (DTYPE=float32: bystanders' tokens must match exactly;
                                                    in bf16 a different batch may round differently)
"""
import json
import os
import re
import sys

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.engine import model_runner

MODEL = os.environ.get("NANOSERVE_MODEL", "qwen3-0.6b-random")


def main(out_path: str) -> None:
    out = {}
    llm = LLM(MODEL, max_model_len=2048, dtype=os.environ.get("DTYPE", "auto"))  # float32: batch-invariant
    prompt = list(range(1000, 1600))
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3)
    whole = llm.generate([prompt], scored, use_tqdm=False)[0]
    model_runner.LOGIT_ROWS = 3
    chunked = llm.generate([prompt], scored, use_tqdm=False)[0]
    model_runner.LOGIT_ROWS = 256
    pairs = list(zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]))
    out["prompt_logprobs_chunked_same_top_tokens"] = f"{sum(a.keys() == b.keys() for a, b in pairs)}/{len(pairs)}"
    out["prompt_logprobs_chunked_max_abs_diff"] = max(abs(a[t] - b[t]) for a, b in pairs for t in a.keys() & b.keys())
    out["generated_tokens_same"] = whole.outputs[0].token_ids == chunked.outputs[0].token_ids

    plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    alone = llm.generate(["The plain one"], plain, use_tqdm=False)[0].outputs[0].token_ids
    specs = [StructuredOutputsParams(regex="[a-z ]{1,40}"), StructuredOutputsParams(choice=["red", "green"]),
             StructuredOutputsParams(json_object=True)]
    prompts = ["The plain one"] + [f"Answer {i}:" for i in range(24)]
    params = [plain] + [SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=specs[i % 3])
                        for i in range(24)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    follows = []
    for o, p in zip(outs[1:], params[1:]):
        text, spec = o.outputs[0].text, p.structured_outputs
        ok = (re.fullmatch("[a-z ]{1,40}", text) is not None if spec.regex else text in ("red", "green")
              if spec.choice else o.outputs[0].finish_reason == "length" or isinstance(json.loads(text), dict))
        follows.append(ok)
    out["structured_outputs_follow"] = f"{sum(follows)}/{len(follows)}"
    out["plain_tokens_same_beside_them"] = outs[0].outputs[0].token_ids == alone

    word = llm.tokenizer.encode(" hello", add_special_tokens=False)
    stuck = SamplingParams(max_tokens=4, allowed_token_ids=word, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    stuck_out, beside = llm.generate(["hi", "The plain one"], [stuck, plain], use_tqdm=False)
    out["contradiction_fails_alone"] = stuck_out.outputs[0].finish_reason == "error" and \
        beside.outputs[0].token_ids == alone
    out["contradiction_error"] = stuck_out.error
    try:
        llm.generate(["hi"], SamplingParams(stop_token_ids=[llm.model.config.vocab_size], min_tokens=1), use_tqdm=False)
        out["out_of_vocab_refused"] = False
    except ValueError as e:
        out["out_of_vocab_refused"] = getattr(e, "param", None) == "stop_token_ids"
    print(json.dumps(out, indent=1))
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

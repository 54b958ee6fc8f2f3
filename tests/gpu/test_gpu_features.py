"""The features beside the core on the GPU's path (CUDA graphs, async scheduling with its placeholders resolved on
the device, lesson 06's compiled sampler, a warm prefix cache): logits processors, structured outputs,
prompt_logprobs, and the request-safety rules. float32 where tokens must be equal, bf16 where only the
constraints must hold."""
import json
import random
import re

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from nanoserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoserve.engine import model_runner  # noqa: E402

MODEL = "qwen3-0.6b-random"
EDITING = [dict(repetition_penalty=1.8), dict(frequency_penalty=2.0, temperature=1.0),
           dict(presence_penalty=-1.0, temperature=0.9), dict(min_p=0.2, temperature=1.2),
           dict(logit_bias={17: 100.0}, temperature=0.8), dict(allowed_token_ids=[11, 12, 13], temperature=1.0),
           dict(bad_words=["hello world", "the"]), dict(min_tokens=20, max_tokens=40)]
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "b", "c"]},
                         "name": {"type": "string", "maxLength": 8}},
          "required": ["id", "tag", "name"], "additionalProperties": False}
CONSTRAINTS = {"json": StructuredOutputsParams(json=SCHEMA),
               "regex": StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"),
               "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma"])}


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _random_prompts(rng, count, longest=40):
    return [[rng.randrange(1, 50000) for _ in range(rng.randint(4, longest))] for _ in range(count)]


def _follows(kind, text):
    if kind == "json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return set(value) == {"id", "tag", "name"} and isinstance(value["id"], int) and 0 <= value["id"] <= 999 \
            and value["tag"] in ("a", "b", "c") and isinstance(value["name"], str) and len(value["name"]) <= 8
    if kind == "regex":
        return re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text) is not None
    return text in ("alpha", "beta", "gamma")


def test_logits_processors_give_the_same_tokens_alone_batched_and_eager():
    rng = random.Random(0)
    prompts = _random_prompts(rng, len(EDITING))
    params = [SamplingParams(max_tokens=kw.pop("max_tokens", 32), seed=i, **kw) for i, kw in
              enumerate(dict(e) for e in EDITING)]
    plain_prompts = _random_prompts(rng, 40)
    plain = [SamplingParams(max_tokens=32, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(40)]
    with LLM(MODEL, dtype="float32", max_model_len=1024) as fast:
        engine = fast.engine
        assert engine.runner.graphs is not None and engine.async_scheduling
        alone = [_tokens(fast, [p], [sp])[0] for p, sp in zip(prompts, params)]
        ahead = engine.stats.steps_ahead
        mixed = _tokens(fast, prompts + plain_prompts, params + plain)
        assert engine.stats.steps_ahead > ahead  # async scheduling still runs ahead with edited rows in the batch
        plain_only = _tokens(fast, plain_prompts, plain)
        del engine
    assert mixed[:len(prompts)] == alone
    assert mixed[len(prompts):] == plain_only
    with LLM(MODEL, dtype="float32", max_model_len=1024, enforce_eager=True) as eager:
        assert _tokens(eager, prompts, params) == alone
        assert _tokens(eager, plain_prompts, plain) == plain_only


def test_logits_processors_constraints_hold_in_bf16():
    rng = random.Random(0)
    prompts = _random_prompts(rng, len(EDITING))
    params = [SamplingParams(max_tokens=kw.pop("max_tokens", 32), seed=i, **kw) for i, kw in
              enumerate(dict(e) for e in EDITING)]
    with LLM(MODEL, max_model_len=1024) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs if o.error] == []
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(t in (11, 12, 13) for t in ids[5])  # allowed_token_ids
        assert ids[4] == [17] * len(ids[4])  # a +100 bias forces its token
        banned = [llm.tokenizer.encode(w, add_special_tokens=False)
                  for w in ("hello world", "the", " hello world", " the")]
        assert not any(ids[6][i:i + len(w)] == w for w in banned for i in range(len(ids[6])))
        assert len(ids[7]) >= 20  # min_tokens
        eos = min(llm.eos_token_ids)
        early = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, min_tokens=7,
                                                          logit_bias={eos: 100.0}), use_tqdm=False)[0]
        assert early.error is None and early.outputs[0].finish_reason == "stop"
        assert len(early.outputs[0].token_ids) == 8  # EOS is held back for 7 tokens, then wins


def test_prompt_logprobs_and_structured_outputs_match_the_eager_engine():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50000) for _ in range(n)] for n in (3, 40, 200, 700, 1500, 2100)]
    scoring = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5)
    kinds = list(CONSTRAINTS) * 4
    structured = [SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured_outputs=CONSTRAINTS[k])
                  for i, k in enumerate(kinds)]
    structured_prompts = _random_prompts(rng, len(kinds), longest=60)
    plain_prompts = _random_prompts(rng, 40, longest=60)
    plain = [SamplingParams(max_tokens=48, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(40)]
    # 2,100 tokens go in in chunks; half of each prompt is in the prefix cache first
    with LLM(MODEL, dtype="float32", max_model_len=4096, max_num_batched_tokens=2048) as fast:
        fast.generate([p[:len(p) // 2 + 1] for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)
        got = fast.generate(prompts, scoring, use_tqdm=False)
        mixed = fast.generate(structured_prompts + plain_prompts, structured + plain, use_tqdm=False)
        alone = [_tokens(fast, [p], [sp])[0] for p, sp in zip(structured_prompts[:6], structured[:6])]
    for kind, out in zip(kinds, mixed):
        assert _follows(kind, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", out.outputs[0].text
    assert [o.outputs[0].token_ids for o in mixed[:6]] == alone
    with LLM(MODEL, dtype="float32", max_model_len=4096, enforce_eager=True, async_scheduling=False,
             enable_prefix_caching=False) as eager:
        want = eager.generate(prompts, scoring, use_tqdm=False)
    for p, a, b in zip(prompts, got, want):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(p)
        assert max(abs(a.prompt_logprobs[j][p[j]] - b.prompt_logprobs[j][p[j]]) for j in range(1, len(p))) < 1e-3
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_request_safety_on_the_gpu_path():
    with LLM(MODEL, max_model_len=2048, dtype="float32") as llm:
        # prompt_logprobs scored 256 rows at a time (the default) and 3 at a time: the same
        prompt = list(range(1000, 1600))
        scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3)
        whole = llm.generate([prompt], scored, use_tqdm=False)[0]
        rows = model_runner.LOGIT_ROWS
        try:
            model_runner.LOGIT_ROWS = 3
            chunked = llm.generate([prompt], scored, use_tqdm=False)[0]
        finally:
            model_runner.LOGIT_ROWS = rows
        # each prompt token's own log-prob (a row scored in the wrong chunk would be far off; the top-3 beside it
        # may swap near-ties)
        assert max(abs(whole.prompt_logprobs[j][t] - chunked.prompt_logprobs[j][t])
                   for j, t in enumerate(prompt) if j) < 1e-4
        assert whole.outputs[0].token_ids == chunked.outputs[0].token_ids
        # a plain request's tokens are the same alone and beside structured ones
        plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        alone = llm.generate(["The plain one"], plain, use_tqdm=False)[0].outputs[0].token_ids
        specs = [StructuredOutputsParams(regex="[a-z ]{1,40}"), StructuredOutputsParams(choice=["red", "green"]),
                 StructuredOutputsParams(json_object=True)]
        params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=specs[i % 3])
                  for i in range(24)]
        outs = llm.generate(["The plain one"] + [f"Answer {i}:" for i in range(24)], [plain] + params, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone
        for o, p in zip(outs[1:], params):
            text, spec = o.outputs[0].text, p.structured_outputs
            if spec.regex:
                assert re.fullmatch("[a-z ]{1,40}", text), text
            elif spec.choice:
                assert text in ("red", "green")
            else:
                assert o.outputs[0].finish_reason == "length" or isinstance(json.loads(text), dict), text
        # constraints that leave no token end their own request, with an error, and no other
        word = llm.tokenizer.encode(" hello", add_special_tokens=False)
        stuck = SamplingParams(max_tokens=4, allowed_token_ids=word,
                               structured_outputs=StructuredOutputsParams(choice=["yes"]))
        stuck_out, beside = llm.generate(["hi", "The plain one"], [stuck, plain], use_tqdm=False)
        assert stuck_out.outputs[0].finish_reason == "error" and "forbid every token" in stuck_out.error
        assert beside.outputs[0].token_ids == alone
        with pytest.raises(ValueError) as refused:
            llm.generate(["hi"], SamplingParams(stop_token_ids=[llm.model.config.vocab_size], min_tokens=1),
                         use_tqdm=False)
        assert getattr(refused.value, "param", None) == "stop_token_ids"


def test_logprobs_from_the_top_k_kernel_are_torch_topks(monkeypatch):
    """logprobs and prompt_logprobs through lesson 06's top-k kernel, against the same engine with torch's topk
    (float32, so that no two of a row's likeliest logits tie): the same entries, the same numbers."""
    from nanoserve.features import logprobs

    rng = random.Random(1)
    prompts = _random_prompts(rng, 24)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, logprobs=k, ignore_eos=True,
                             prompt_logprobs=3 if i % 4 == 0 else None) for i, k in enumerate([1, 5, 20] * 8)]
    with LLM(MODEL, dtype="float32", max_model_len=1024) as llm:
        fast = llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(logprobs, "top_k", lambda x, k: tuple(x.topk(k, dim=-1)))
        slow = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert list(a.outputs[0].logprobs) == list(b.outputs[0].logprobs)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        assert a.prompt_logprobs is None or a.prompt_logprobs == b.prompt_logprobs


def _variants(kernel) -> int:
    """How many compiled versions of a Triton kernel this process holds (one per specialisation)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_feature_kernels_compile_once_whatever_the_number_of_rows_using_them():
    """Triton compiles a kernel again for each alignment of its pointer arguments. The processors' rows and slots
    are slices of one tensor, so an odd number of rows before a slice could misalign it: a compile (tenths of a
    second, for every request in the batch) the first time it happens. Odd and even counts share one version."""
    from nanoserve.kernels import triton_fused
    kernels = (triton_fused._min_p_kernel, triton_fused._logit_bias_kernel)
    fields = dict(min_p=0.05, logit_bias={t: -5.0 for t in range(100)}, temperature=0.8, ignore_eos=True)
    with LLM(MODEL, max_model_len=512) as llm:
        counts = []
        for n in (2, 3, 5, 4, 7, 1):
            params = [SamplingParams(seed=i, max_tokens=4 + i, **fields) for i in range(n)]
            outs = llm.generate([[1 + i, 2, 3] for i in range(n)], params, use_tqdm=False)
            assert [o.error for o in outs if o.error] == []
            counts.append([_variants(k) for k in kernels])
    assert counts[0] != [0, 0] and counts == [counts[0]] * len(counts), counts

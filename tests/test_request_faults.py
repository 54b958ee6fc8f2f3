"""One bad request harms no one else: requests are checked completely before they are queued
(max_logprobs), and a failure inside a step that belongs to one request fails that request alone."""
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["Hello there", "Once upon a time", [5, 6, 7, 8], "The capital of France is"]


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def pool_clean(llm):
    bm = llm.engine.cache.block_manager
    return not llm.engine.has_unfinished() and not bm.block_tables and bm.num_free == bm.num_blocks


@pytest.fixture(scope="module", params=[dict(), dict(async_scheduling=True)], ids=["lesson 05", "async"])
def llm(request):
    with LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=3, **request.param) as llm:
        yield llm


def test_logprobs_beyond_max_logprobs_are_refused_before_queueing(llm):
    clean = tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    for k in (21, 200_000, 151_936):
        with pytest.raises(ValueError, match=f"sampling_params 1: logprobs {k} exceeds max_logprobs 20"):
            llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=2, logprobs=k)], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="logprobs 21 exceeds max_logprobs 20"):  # the engine's own check
        llm.engine.add_request([1, 2, 3], SamplingParams(logprobs=21))
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=20), use_tqdm=False)
    assert all(len(step) >= 20 for step in out[0].outputs[0].logprobs)
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == clean


def test_max_logprobs_is_an_llm_argument():
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        LLM("tiny-qwen3", max_logprobs=-1)
    with LLM("tiny-qwen3", max_model_len=64, num_gpu_blocks_override=8, max_logprobs=50) as llm:
        out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2, logprobs=50), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 50


def fail_one(llm, victim_prompt_ids, on_token):
    """Make processing fail for the request with these prompt ids, at its on_token-th token."""
    engine, original = llm.engine, LLMEngine.update

    def update(seq, n, token, lp):
        if seq.prompt_ids == victim_prompt_ids and token is not None and seq.num_output_tokens + 1 == on_token:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer that fails")
        return original(engine, seq, n, token, lp)

    engine.update = update
    return lambda: vars(engine).pop("update")


@pytest.mark.parametrize("on_token", [1, 4])
def test_a_request_that_fails_in_processing_fails_alone(llm, on_token):
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True), GREEDY, GREEDY]
    clean = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    victim = llm.tokenizer.encode(PROMPTS[1])
    undo = fail_one(llm, victim, on_token)
    try:
        out = llm.generate(PROMPTS, params, use_tqdm=False)  # max_num_seqs=3: one request waits at first
    finally:
        undo()
    assert out[1].error and "UnicodeDecodeError" in out[1].error and out[1].error.startswith("prompt 1:")
    assert [c.finish_reason for c in out[1].outputs] == ["error", "error"]  # both completions share the prompt
    assert [tokens([o])[0] for i, o in enumerate(out) if i != 1] == [c for i, c in enumerate(clean) if i != 1]
    assert all(o.error is None for i, o in enumerate(out) if i != 1)
    assert pool_clean(llm)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == clean


def test_a_stream_sees_its_request_fail_and_the_others_go_on(llm):
    clean = tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    undo = fail_one(llm, llm.tokenizer.encode(PROMPTS[0]), 3)
    try:
        items = list(llm.stream(PROMPTS[:2], GREEDY))
    finally:
        undo()
    failed = [it for it in items if it[0] == 0 and it[2] is None]
    assert len(failed) == 1 and failed[0][3] and "UnicodeDecodeError" in failed[0][1]
    assert [it[2] for it in items if it[0] == 1] == clean[1][0]
    assert pool_clean(llm)


def test_a_failed_step_names_its_sequences(llm):
    engine = llm.engine
    engine.add_request([1, 2, 3], GREEDY)
    launch = engine.runner.launch

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    engine.runner.launch = boom
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.step()
    finally:
        vars(engine.runner).pop("launch")
    assert [s.prompt_ids for s in engine.step_seqs] == [[1, 2, 3]]
    for seq in list(engine.step_seqs):
        engine.scheduler.abort(seq)
    assert launch == engine.runner.launch and pool_clean(llm)


def test_a_request_whose_text_cannot_be_decoded_fails_alone(llm, monkeypatch):
    clean = tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    decode = type(llm.tokenizer).decode

    def failing(self, ids, *args, **kwargs):
        if list(ids) == clean[0][0]:  # the whole text of request 0, decoded once at the end
            raise ValueError("cannot decode")
        return decode(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(llm.tokenizer), "decode", failing)
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert out[0].error == "prompt 0: ValueError: cannot decode" and out[0].outputs[0].finish_reason == "error"
    assert out[1].error is None and tokens(out[1:]) == clean[1:]

"""Faults, bad input, re-entrancy and vLLM's API, through LLM as a user calls it (issue: engine hardening)."""
import gc
import shutil
import weakref

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model
from nanoserve.checks.lesson04 import pool_problems
from nanoserve.course.step_records import record_steps
from nanoserve.engine.sequence import completion_seed
from nanoserve.model.zoo import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [(i * 37) % 500 for i in range(300)]  # 300 tokens: several chunks at a budget of 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random Qwen3 checkpoint (vocab 512, untied head: clear greedy margins) with a real tokenizer."""
    path = tmp_path_factory.mktemp("tiny-untied")
    hf_tiny_model(**TINY_CONFIGS["qwen3 group=2 head_dim=128"], tie=False, seed=5).save_pretrained(path)
    for f in resolve_model("tiny-qwen3").glob("tokenizer*"):
        shutil.copy(f, path)
    return path


def make_llm(model_dir, caching=True, chunked=True, **kw):
    kw = {"max_num_batched_tokens": 64 if chunked else 512, **kw}
    # On the CPU on any machine: faults are injected where lesson 05's eager step runs (a GPU replays graphs)
    return LLM(str(model_dir), max_model_len=512, num_gpu_blocks_override=96, block_size=16, device="cpu",
               enable_prefix_caching=caching, enable_chunked_prefill=chunked, **kw)


def tokens(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def assert_pool_clean(llm):
    bm = llm.cache.block_manager
    assert not llm.engine.has_unfinished() and not bm.block_tables and bm.num_free == bm.num_blocks
    assert not any(bm.ref_count)
    if hasattr(bm, "records"):
        assert pool_problems(bm) == []


class Boom(Exception):
    pass


def inject(llm, where, exc, on_call):
    """Make the on_call-th step fail at `where` (before the forward, inside a layer, after sampling); returns
    a function that undoes it."""
    runner, calls = llm.engine.runner, {"n": 0}
    target, name = {"before forward": (runner.builder, "build"), "inside a layer": (llm.cache, "attend"),
                    "after sampling": (runner, "sampler")}[where]
    original = getattr(target, name)

    def failing(*args, **kwargs):
        if where == "inside a layer" and args[0] != 1:  # layer 1 of 2: mid-forward
            return original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == on_call and where != "after sampling":
            raise exc()
        out = original(*args, **kwargs)
        if calls["n"] == on_call:
            raise exc()  # the tokens were sampled, then the step failed
        return out

    setattr(target, name, failing)
    return lambda: setattr(target, name, original)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["before forward", "inside a layer", "after sampling"])
def test_a_failed_step_leaves_the_pool_consistent_and_a_retry_equals_a_clean_run(model_dir, where, exc, caching, chunked):
    clean = tokens(make_llm(model_dir, caching, chunked).generate([PROMPT, PROMPT[:40]], GREEDY, use_tqdm=False))
    llm = make_llm(model_dir, caching, chunked)
    for on_call in (2, 7):  # chunked: mid-prefill and in decode; whole prompts: both in decode
        undo = inject(llm, where, exc, on_call)
        with pytest.raises(exc):
            llm.generate([PROMPT, PROMPT[:40]], GREEDY, use_tqdm=False)
        undo()
        assert_pool_clean(llm)
        assert tokens(llm.generate([PROMPT, PROMPT[:40]], GREEDY, use_tqdm=False)) == clean
        assert_pool_clean(llm)


def test_an_interrupted_prefill_never_shares_unwritten_blocks(model_dir):
    """The issue's repro: a prompt interrupted at every point of its chunked prefill, then retried."""
    clean = tokens(make_llm(model_dir).generate([PROMPT], GREEDY, use_tqdm=False))
    llm = make_llm(model_dir)
    for on_call in range(1, 7):  # 300 tokens in chunks of 64: five prefill steps, then decode
        undo = inject(llm, "inside a layer", KeyboardInterrupt, on_call)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
        undo()
        assert tokens(llm.generate([PROMPT], GREEDY, use_tqdm=False)) == clean
        assert_pool_clean(llm)


@pytest.mark.parametrize("bad", [
    ["Hello world", [{"role": "user"}]],  # chat messages belong to LLM.chat
    ["Hello world", None],
    ["Hello world", "\ud800"],  # a lone surrogate: the tokenizer cannot encode it
    ["Hello world", [1.5, 2]],
    42,
])
def test_a_malformed_call_raises_before_queueing_and_the_next_call_works(model_dir, bad):
    llm = make_llm(model_dir)
    want = tokens(llm.generate(["Hello world"], GREEDY, use_tqdm=False))
    with pytest.raises((TypeError, ValueError), match="prompt 1|prompt|PROMPT|a prompt"):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert tokens(llm.generate(["Hello world"], GREEDY, use_tqdm=False)) == want


def test_bad_sampling_params_and_bad_chats_raise_before_queueing(model_dir):
    llm = make_llm(model_dir)
    want = tokens(llm.generate(["Hello world"], GREEDY, use_tqdm=False))
    with pytest.raises(TypeError, match="sampling_params 1"):
        llm.generate(["a", "b"], [GREEDY, None])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="conversation 1"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user"}]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert tokens(llm.generate(["Hello world"], GREEDY, use_tqdm=False)) == want


def test_interleaved_streams_and_generate_each_get_their_own_tokens(model_dir):
    llm = make_llm(model_dir)
    prompts = [PROMPT[:30], PROMPT[50:70], PROMPT[100:140]]
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    first, second = llm.stream(prompts[:2], GREEDY), llm.stream([prompts[2]], GREEDY)
    got, live, reads = {0: [], 1: [], 2: []}, [first, second], 0
    while live:  # read them alternately, one item at a time
        for stream in list(live):
            item = next(stream, None)
            if item is None:
                live.remove(stream)
                continue
            got[2 if stream is second else item[0]].append(item[2])
            reads += 1
            if reads == 5:  # and a whole generate call while both streams are half-read
                assert tokens(llm.generate([prompts[1]], GREEDY, use_tqdm=False))[0] == alone[1]
    assert [got[0], got[1], got[2]] == alone
    assert_pool_clean(llm)


def test_n_completions_share_the_prompt_blocks_and_equal_seeded_requests(model_dir):
    sampling = SamplingParams(temperature=1.5, max_tokens=8, seed=7, n=3, ignore_eos=True)
    llm = make_llm(model_dir, caching=False)
    shared_steps = record_steps(llm.engine)
    out = llm.generate([PROMPT[:40]], sampling, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [SamplingParams(temperature=1.5, max_tokens=8, seed=completion_seed(7, i), ignore_eos=True) for i in range(3)]
    separate = make_llm(model_dir, caching=False)
    separate_steps = record_steps(separate.engine)
    want = tokens(separate.generate([PROMPT[:40]] * 3, alone, use_tqdm=False))
    assert [c.token_ids for c in out.outputs] == want and len({tuple(t) for t in want}) == 3
    # 40 tokens: 2 full blocks shared
    assert max(r.blocks_used for r in shared_steps) < max(r.blocks_used for r in separate_steps)
    assert_pool_clean(llm)
    items = list(llm.stream([PROMPT[:20]], SamplingParams(max_tokens=4, n=2, seed=1)))
    assert sorted(i.completion for i in items) == [0] * 4 + [1] * 4


def test_logprobs_are_the_models_raw_log_probabilities(model_dir):
    llm = make_llm(model_dir)
    out = llm.generate([PROMPT[:20]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5 and c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    for token, lp in zip(c.token_ids, c.logprobs):
        assert token in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())
        assert lp[token] == max(lp.values()) and lp[token].rank == 1  # greedy: the likeliest token
        assert sorted(v.rank for v in lp.values()) == [1, 2, 3] and lp[token].logprob == float(lp[token])
    hot = llm.generate([PROMPT[:20]], SamplingParams(temperature=0.7, max_tokens=5, seed=3, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert all(list(lp) == [t] for t, lp in zip(hot.token_ids, hot.logprobs))  # logprobs=0: the token's own
    exact = llm.generate([PROMPT[:20]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    with torch.inference_mode():  # the values are the model's own log-softmax at the prompt's last position
        from nanoserve.course.no_cache import NoCache
        ids = torch.tensor(PROMPT[:20])
        want = llm.model.compute_logits(llm.model(ids, torch.arange(20), NoCache())[-1:]).log_softmax(-1)[0]
    assert abs(c.logprobs[0][c.token_ids[0]] - want[c.token_ids[0]].item()) < 1e-4 and exact.outputs[0].token_ids
    assert llm.generate([PROMPT[:20]], GREEDY, use_tqdm=False)[0].outputs[0].logprobs is None


def test_tiny_temperatures_are_greedy(model_dir):
    llm = make_llm(model_dir)
    greedy = tokens(llm.generate([PROMPT[:20]], GREEDY, use_tqdm=False))
    assert tokens(llm.generate([PROMPT[:20]], SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)) == greedy


def test_chat_takes_one_conversation_or_several(model_dir):
    llm = make_llm(model_dir)
    one = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    two = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(two) == 2 and tokens(one)[0] == tokens(two)[0]
    assert llm.llm_engine is llm.engine and llm.get_tokenizer() is llm.tokenizer  # vLLM's names
    assert "Hi" in one[0].prompt


def test_dtype_names_as_vllm_takes_them(model_dir):
    assert LLM(str(model_dir), dtype="auto").model.lm_head.weight.dtype == torch.float32  # a CPU: float32
    assert LLM(str(model_dir), dtype="half").model.lm_head.weight.dtype == torch.float16
    assert LLM(str(model_dir), dtype=torch.bfloat16).model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be.*bfloat16"):
        LLM(str(model_dir), dtype="float33")


@pytest.mark.parametrize("arg, value", [("block_size", 0), ("num_gpu_blocks_override", -3), ("max_num_seqs", 0),
                                        ("max_model_len", 0), ("max_num_batched_tokens", 0),
                                        ("gpu_memory_utilization", 0), ("device", "bogus")])
def test_bad_engine_arguments_name_themselves(model_dir, arg, value):
    with pytest.raises(ValueError, match=arg if arg != "device" else "device"):
        LLM(str(model_dir), **{arg: value})


def test_generate_forms_and_errors(model_dir):
    llm = make_llm(model_dir)
    assert llm.generate([], use_tqdm=False) == []
    for bad in (42, torch.tensor([1, 2])):
        with pytest.raises(TypeError, match="a prompt is"):
            llm.generate(bad)
    outs = llm.generate([[5, 6], "", [1] * 600], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False]
    assert outs[1].error.startswith("prompt 1:") and outs[2].error.startswith("prompt 2:")


def test_memory_is_released_by_dropping_or_shutting_down(model_dir):
    llm = make_llm(model_dir)
    llm.generate(["x"], GREEDY, use_tqdm=False)
    model, cache = weakref.ref(llm.model), weakref.ref(llm.cache)
    del llm
    gc.collect()
    assert model() is None and cache() is None  # nothing (no reference cycle) keeps them alive
    with make_llm(model_dir) as llm:
        llm.generate(["x"], GREEDY, use_tqdm=False)
        cache = weakref.ref(llm.cache)
    assert cache() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["x"], GREEDY, use_tqdm=False)


def test_generated_text_equals_streamed_text(model_dir):
    """generate decodes a finished output once; a stream decodes it token by token: the same text."""
    llm = make_llm(model_dir)
    prompts = [PROMPT[i:i + 12] for i in range(0, 120, 12)]
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(prompts, sampling, use_tqdm=False)]
    streamed = [""] * len(prompts)
    for item in llm.stream(prompts, sampling):
        streamed[item[0]] += item[1]
    assert texts == streamed and any(texts)


@pytest.mark.parametrize("caching", [True, False])
def test_an_interrupt_while_admitting_a_request_leaks_nothing(model_dir, caching):
    """Ctrl-C right after a prompt got its blocks, before it joined the running queue."""
    clean = tokens(make_llm(model_dir, caching).generate([PROMPT[:50], PROMPT[:70]], GREEDY, use_tqdm=False))
    llm = make_llm(model_dir, caching)
    reserve, calls = llm.cache.reserve, []

    def reserve_then_interrupt(seq_id, prompt_ids):
        cached = reserve(seq_id, prompt_ids)
        calls.append(seq_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return cached
    llm.cache.reserve = reserve_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT[:50], PROMPT[:70]], GREEDY, use_tqdm=False)
    llm.cache.reserve = reserve
    assert_pool_clean(llm)
    assert tokens(llm.generate([PROMPT[:50], PROMPT[:70]], GREEDY, use_tqdm=False)) == clean




@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler, which raises KeyboardInterrupt, as in a terminal or a notebook (a process
    started in the background of a shell inherits SIGINT ignored)."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_bookkeeping_comes_as_it_ends_once_and_only_in_the_main_thread(sigint_raises):
    import signal
    import threading

    from nanoserve.engine.interrupts import held_interrupts
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            with held_interrupts():
                signal.raise_signal(signal.SIGINT)
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held_interrupts():  # nothing held: nothing raised
        pass
    in_thread = []
    thread = threading.Thread(target=lambda: in_thread.append(held_interrupts().__enter__() is None))
    thread.start()
    thread.join()
    assert in_thread == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_ctrl_c_in_one_call_leaves_a_stream_beside_it_as_it_would_be(async_scheduling, sigint_raises):
    """A stream goes on after another call on its LLM was stopped (Ctrl-C) as one part of a step returned, or
    in the middle of one: its completions (a stop string, log-probs, n=2, a grammar) get the tokens and text
    they get undisturbed, and the pool is whole at the end."""
    import contextlib
    import signal

    from nanoserve import StructuredOutputsParams
    from nanoserve.engine.detokenizer import Detokenizer
    from nanoserve.engine.request import Request
    llm = LLM("tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=64,
              async_scheduling=async_scheduling)
    prompts = ["one two three", "four five six seven"]
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=10, stop=["zz"], logprobs=1, n=2),
              SamplingParams(temperature=0.8, seed=4, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6})*"))]

    @contextlib.contextmanager
    def ctrl_c(where, k):
        """A Ctrl-C at the k-th call of `where`'s function: as it returns (in the detokenizer: as it begins). As a
        finished sequence's blocks go back, a real SIGINT, which Python raises at its next check: at once, unless
        held."""
        owner, name = {"the scheduler hands out a step": (llm.engine.scheduler, "schedule"),
                       "a token is appended": (Request, "append"), "inside the detokenizer": (Detokenizer, "add"),
                       "a step's tokens are routed": (llm.router, "route"),
                       "blocks go back to the pool": (llm.cache.block_manager, "_return_blocks")}[where]
        original, calls = getattr(owner, name), [0]

        def then_stop(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k and owner is llm.cache.block_manager:
                signal.raise_signal(signal.SIGINT)
                return original(*args, **kwargs)
            if calls[0] == k and owner is Detokenizer:
                raise KeyboardInterrupt
            out = original(*args, **kwargs)
            if calls[0] == k:
                raise KeyboardInterrupt
            return out
        setattr(owner, name, then_stop)
        try:
            yield
        finally:
            setattr(owner, name, original)

    def stream_beside(where=None, k=None):
        stream, got = llm.stream(prompts, params), {}
        for n, item in enumerate(stream):
            got.setdefault((item[0], item.completion), []).append((item[2], item[1]))
            if n == 2:  # the stream's requests run: another call now, stopped at its k-th call of `where`
                with contextlib.ExitStack() as stack:
                    if k is not None:
                        stack.enter_context(pytest.raises(KeyboardInterrupt))
                        stack.enter_context(ctrl_c(where, k))
                    llm.generate(["the lazy dog"] * 3, SamplingParams(temperature=0.8, seed=5, max_tokens=8),
                                 use_tqdm=False)
        return got
    clean = stream_beside()
    for where in ("the scheduler hands out a step", "a token is appended", "inside the detokenizer",
                  "a step's tokens are routed", "blocks go back to the pool"):
        for k in (1, 3):
            assert stream_beside(where, k) == clean, f"a Ctrl-C as {where}, at call {k}"
    assert_pool_clean(llm)

"""Lesson 05: the scheduler and the engine. A stress test and the API (exercise checks: test_exercises.py)."""
import random

import pytest

from nanoserve.checks import lesson05 as checks
from nanoserve.course.step_records import record_steps
from nanoserve.engine.llm import LLM
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams


def test_batch_invariance_with_preemption_chunking_and_prefix_caching():
    checks.check_batch_invariance(LLMEngine)


# Wrong answers to exercise 5.4 that its check must catch: (a piece of the engine's step, what a learner writes
# instead, what the check's message says)
WRONG_STEPS = {
    "never launches ahead": ("if self.async_scheduling:", "if False:", "not launched ahead"),
    "launches ahead unfed": ("previous=current", "previous=None", "without previous=current"),
    "collects the step ahead": ("self.runner.collect(current)", "self.runner.collect(self.in_flight or current)",
                                "collect the current step"),
    "forgets nothing": ("self.cancel_steps(self.in_flight, current)", "pass", "take back all it counted"),
    "forgets the step ahead only": ("self.cancel_steps(self.in_flight, current)", "self.cancel_steps(self.in_flight)",
                                    "take back all it counted"),
    "Ctrl-C goes past": ("except BaseException:", "except Exception:", "KeyboardInterrupt"),
    "swallows the error": ("        raise\n", "        return []\n", "raises it again"),
    "no step_seqs": ("self.step_seqs = current.batch.seqs", "pass", "step_seqs"),
    "in_flight kept": ("current, self.in_flight = self.in_flight, None", "current = self.in_flight", "in_flight"),
    "an empty step ahead's preemptions": ("self.stats.preemptions += 0 if ahead.seqs else len(ahead.preempted)", "pass",
                                          "preemptions"),
    "no steps_ahead": ("self.stats.steps_ahead += 1", "pass", "steps_ahead"),
    "tokens to the wrong sequences": ("self.process(current, tokens, logprobs)",
                                      "self.process(current, tokens[::-1], logprobs)", "process the step"),
}


@pytest.mark.parametrize("old, new, message", WRONG_STEPS.values(), ids=WRONG_STEPS)
def test_the_step_check_catches_wrong_loops(old, new, message):
    import inspect
    import textwrap

    import nanoserve.engine.llm_engine as module

    source = textwrap.dedent(inspect.getsource(LLMEngine.step))
    assert source.count(old) == 1, old
    scope = dict(vars(module))
    exec(source.replace(old, new), scope)
    wrong = type("Wrong", (LLMEngine,), {"step": scope["step"]})
    with pytest.raises(AssertionError, match=message):
        checks.check_step(wrong)


@pytest.fixture(scope="module")
def tiny_engine_parts():
    from nanoserve.model.loader import load_model
    from nanoserve.model.zoo import resolve_model

    return load_model(resolve_model("tiny-qwen3"), device="cpu")


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_stress_random_arrivals_tiny_pool(tiny_engine_parts, prefix_caching):
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.cache.prefix import PrefixCachingKVCache

    model, rng = tiny_engine_parts, random.Random(5)
    cache = (PrefixCachingKVCache if prefix_caching else PagedKVCache)(model.config, num_blocks=20, block_size=4)
    engine = LLMEngine(model, cache, max_num_seqs=6, max_num_batched_tokens=12)
    steps = record_steps(engine)
    stems = [[rng.randrange(1000) for _ in range(20)] for _ in range(3)]
    seqs, step = [], 0
    while step < 60 or engine.has_unfinished():
        if step < 60 and rng.random() < 0.4:  # requests keep arriving for 60 steps
            prompt = rng.choice(stems)[:rng.randint(1, 20)] + [rng.randrange(1000) for _ in range(rng.randint(0, 8))]
            seqs.append(engine.add_request(prompt, SamplingParams(temperature=rng.choice([0, 1.0]),
                                                                  max_tokens=rng.randint(1, 30), ignore_eos=True)))
        if engine.has_unfinished():
            engine.step()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert all(r.num_tokens <= 12 and len(r.prefill) + len(r.decode) <= 6 for r in steps)
    assert not cache.block_manager.block_tables and cache.block_manager.num_free == 20  # no leak
    assert sum(len(r.preempted) for r in steps) > 0  # the tiny pool really forced preemptions


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3", max_model_len=256, num_gpu_blocks_override=128, max_num_batched_tokens=64)


def test_generate_takes_strings_token_ids_and_chats_and_keeps_order(llm):
    prompts = ["Hello there", [1, 2, 3, 4], {"prompt": "Hi!"}, {"prompt_token_ids": [7, 8, 9]}, "A longer prompt, " * 5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 2, 4, 4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1", "2", "3", "4"]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5, 2, 4, 4]
    assert outputs[0].prompt == "Hello there" and outputs[1].prompt_token_ids == [1, 2, 3, 4]
    assert outputs[2].prompt == "Hi!" and outputs[3].prompt_token_ids == [7, 8, 9]
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outputs)
    # the same prompt alone gives the same tokens
    alone = llm.generate(prompts[4], params[4], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[4].outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "Hi!"}], params[2], use_tqdm=False)[0]
    assert chat.prompt.endswith("<|im_start|>assistant\n") or "assistant" in chat.prompt
    assert len(chat.outputs[0].token_ids) == 2


def test_bad_requests_fail_alone(llm):
    outputs = llm.generate(["", "fine", [5] * 300, [10**9]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length", "error", "error"]
    assert "empty" in outputs[0].error and "max_model_len" in outputs[2].error and "token ids" in outputs[3].error
    assert outputs[3].error.startswith("prompt 3:")


def test_stream_yields_each_token_as_it_comes(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    events = list(llm.stream(["Hello there", "Bye"], params))
    per_prompt = {i: [t for j, _, t, _ in events if j == i] for i in (0, 1)}
    final = llm.generate(["Hello there", "Bye"], params, use_tqdm=False)
    assert per_prompt == {i: final[i].outputs[0].token_ids for i in (0, 1)}
    assert [done for j, _, _, done in events if j == 0][-1] is True


def test_unsupported_settings_are_clear_errors():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM("tiny-qwen3", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM("tiny-qwen3", gpu_memory_utilization=1.5)


def test_without_chunked_prefill_prompts_go_whole_and_preempted_ones_still_resume(tiny_engine_parts):
    from nanoserve.cache.paged import PagedKVCache

    model = tiny_engine_parts
    cache = PagedKVCache(model.config, num_blocks=12, block_size=4)
    engine = LLMEngine(model, cache, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=2))
    seqs = [engine.add_request(list(range(1, 13)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            for _ in range(3)]
    while engine.has_unfinished():
        batch_tokens = engine.step()
        for seq, token in batch_tokens:  # a first prefill is never split
            assert seq.num_preemptions or token is not None or seq.output_ids
    assert all(len(s.output_ids) == 30 for s in seqs)
    assert engine.stats.preemptions > 0


def test_out_of_range_token_ids_fail_alone_and_leave_the_llm_usable(llm):
    vocab = llm.model.config.vocab_size
    outputs = llm.generate(["fine", [vocab + 5], [-1]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "error"]
    with pytest.raises(TypeError, match="prompt 1"):  # malformed: the call raises, nothing is queued
        llm.generate(["fine", None], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate(["fine"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].error is None


def test_a_stream_stopped_early_frees_its_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stream = llm.stream(["Hello there", "Bye"], params)
    next(stream)
    stream.close()  # the caller stops reading
    assert not llm.engine.has_unfinished() and not llm.cache.block_manager.block_tables
    assert len(llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_bench_refuses_the_full_workload_on_a_cpu(capsys):
    from nanoserve.cli import main

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench"]) == 2
    assert "measures a GPU" in capsys.readouterr().err


def test_the_workload_takes_maxima_under_nano_vllms_minimum():
    from nanoserve.bench import workload

    prompts, max_tokens = workload(16, max_input_len=50, max_output_len=20)  # `bench-serve --max-input-len 50`
    assert all(1 <= len(p) <= 50 for p in prompts) and all(1 <= m <= 20 for m in max_tokens)
    _, max_tokens = workload()  # the course's workload is unchanged
    assert sum(max_tokens) == 133_966


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_run_their_sequences_longest_first(async_scheduling):
    # The runner hands each decode step to the builder longest context first (lesson 06: the decode kernel's grid
    # then starts its longest work first). Every list of the step is reordered alike, so each request still gets
    # the tokens it gets alone, with placeholders fed from the reordered step before (async scheduling).
    llm = LLM("tiny-qwen3", max_model_len=256, num_gpu_blocks_override=64, async_scheduling=async_scheduling)
    builder, seen = llm.engine.runner.builder, []
    build = builder.build

    def spy(cache, seqs, *args, **kwargs):
        if all(len(tokens) == 1 for _, _, tokens in seqs):
            seen.append([start + 1 for _, start, _ in seqs])  # each sequence's context length
        return build(cache, seqs, *args, **kwargs)

    builder.build = spy
    prompts = [[5] * 4, [6] * 40, [7] * 17, [8] * 9]  # admitted in this order, so unsorted at first
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert seen and all(lengths == sorted(lengths, reverse=True) for lengths in seen)
    assert any(len(lengths) == 4 for lengths in seen)
    assert together == [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

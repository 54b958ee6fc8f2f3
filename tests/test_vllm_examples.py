"""vLLM's simple offline examples, written again here: what a vLLM user writes works with the import
and the model name changed. basic, chat, generate with EngineArgs, prefix caching, reproducibility, default
sampling, structured outputs."""
import argparse
import json
import re
from pathlib import Path

import jsonschema
import pytest

from nanoserve import LLM, EngineArgs, SamplingParams, StructuredOutputsParams

MODEL = dict(model="tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=64)
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]


@pytest.fixture(scope="module")
def llm():
    with LLM(**MODEL) as llm:
        yield llm


def test_basic(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(o.outputs[0].text and len(o.outputs[0].token_ids) <= 16 for o in outputs)  # vLLM's default 16


def test_chat_with_a_batch_of_conversations_tools_and_a_template(llm):
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Write an essay about the importance of higher education."}]
    params = SamplingParams(temperature=0.5, max_tokens=8)
    one = llm.chat(conversation, params, use_tqdm=False)
    batch = llm.chat([conversation] * 3, params, use_tqdm=False)
    assert len(one) == 1 and len(batch) == 3 and all(o.outputs[0].text for o in batch)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = llm.chat(conversation, params, tools=[tool], use_tqdm=False)[0]
    assert len(with_tools.prompt_token_ids) > len(one[0].prompt_token_ids)  # the template describes the tool
    cont = llm.chat(conversation[:2] + [{"role": "assistant", "content": "Well,"}], params, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.tokenizer.decode(cont.prompt_token_ids).endswith("Well,")
    mine = llm.chat(conversation, params, chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}",
                    use_tqdm=False)[0]
    assert llm.tokenizer.decode(mine.prompt_token_ids).startswith("You are a helpful assistant\nHello\n")


def test_generate_with_engine_args():
    args = EngineArgs(**MODEL, max_num_seqs=8)
    llm = LLM(engine_args=args)
    params = llm.get_default_sampling_params()
    params.max_tokens = 4
    assert all(len(o.outputs[0].token_ids) <= 4 for o in llm.generate(PROMPTS, params, use_tqdm=False))


def test_prefix_caching_gives_the_same_text_and_finds_the_prefix():
    prefix = "You are an expert school principal, skilled in effectively managing faculty and staff. " * 3
    prompts = [prefix + p for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0)
    plain = LLM(**MODEL).generate(prompts, greedy, use_tqdm=False)
    cached_llm = LLM(**MODEL, enable_prefix_caching=True)
    cached_llm.generate(prompts[0], greedy, use_tqdm=False)  # warm the cache with one prompt
    cached = cached_llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].text for o in plain] == [o.outputs[0].text for o in cached]
    assert all(o.num_cached_tokens > 0 for o in cached)
    # vLLM's reset_prefix_cache: refused while a request holds blocks, then every cached block forgotten
    held = cached_llm.engine.add_request(cached_llm.tokenizer.encode(prompts[0]), greedy)
    cached_llm.engine.step()  # its prompt computed: it holds blocks
    assert cached_llm.reset_prefix_cache() is False
    cached_llm.engine.scheduler.abort(held)
    assert cached_llm.reset_prefix_cache() is True
    again = cached_llm.generate(prompts, greedy, use_tqdm=False)
    assert again[0].num_cached_tokens == 0 and [o.outputs[0].text for o in again] == [o.outputs[0].text for o in plain]


def test_reproducibility_with_a_seed():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    first = [o.outputs[0].text for o in LLM(**MODEL, seed=0).generate(PROMPTS, params, use_tqdm=False)]
    second = [o.outputs[0].text for o in LLM(**MODEL, seed=0).generate(PROMPTS, params, use_tqdm=False)]
    assert first == second
    unseeded = SamplingParams(temperature=1.0)  # the LLM's seed makes the unseeded ones reproducible too
    assert [o.outputs[0].text for o in LLM(**MODEL, seed=3).generate(PROMPTS, unseeded, use_tqdm=False)] == \
        [o.outputs[0].text for o in LLM(**MODEL, seed=3).generate(PROMPTS, unseeded, use_tqdm=False)]


def test_structured_outputs(llm):
    choice = llm.generate("Classify: great!", SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"])), use_tqdm=False)[0]
    assert choice.outputs[0].text in ("Positive", "Negative")
    email = llm.generate("An e-mail address:", SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
        regex=r"[a-z]{1,8}@[a-z]{1,8}\.com\n")), use_tqdm=False)[0]
    assert re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.com\n", email.outputs[0].text)
    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 8},
                                               "type": {"enum": ["sedan", "SUV", "truck"]}},
              "required": ["brand", "type"], "additionalProperties": False}
    car = llm.generate("A car as JSON:", SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=schema)), use_tqdm=False)[0]
    jsonschema.validate(json.loads(car.outputs[0].text), schema)


def test_request_outputs_carry_vllms_fields(tmp_path):
    import shutil

    from nanoserve.model.zoo import resolve_model
    folder = tmp_path / "tokenizer"  # a tokenizer of its own (here a copy of the model's, in another folder)
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("tiny-qwen3") / name, folder / name)
    llm = LLM(**MODEL, tokenizer=str(folder))
    assert str(folder) in str(llm.tokenizer.name_or_path)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1, n=2), use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1"]  # vLLM's ids are strings
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
        assert m.time_in_queue >= 0
        for step in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
            assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in step.items())


def test_nano_vllms_example_reads_outputs_as_dicts(llm):
    outputs = llm.generate(["introduce yourself"], SamplingParams(temperature=0.6, max_tokens=8), use_tqdm=False)
    assert outputs[0]["text"] == outputs[0].outputs[0].text and outputs[0]["token_ids"] == outputs[0].outputs[0].token_ids


def test_vllms_module_paths_and_idioms(llm, caplog):
    """vLLM's examples import from vllm.outputs, vllm.sampling_params and vllm.logger, pass
    trust_remote_code=False, and give chat content as OpenAI's text parts."""
    import logging

    from nanoserve.logger import init_logger
    from nanoserve.outputs import CompletionOutput, RequestOutput
    from nanoserve.sampling_params import SamplingParams as SP, StructuredOutputsParams as SOP

    assert SP is SamplingParams and SOP is StructuredOutputsParams
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    logger = init_logger(__name__)
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        logger.info("hello from a vLLM script")
    assert "hello from a vLLM script" in caplog.text
    assert EngineArgs(model="tiny-qwen3", trust_remote_code=False).trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineArgs(model="tiny-qwen3", trust_remote_code=True)
    params = SamplingParams(temperature=0, max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    as_parts, as_text = (llm.chat(m, params, use_tqdm=False)[0] for m in (parts, joined))
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids and as_parts.outputs[0].text == as_text.outputs[0].text
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_engine_args_on_a_command_line_as_vllms_generate_example():
    """vLLM's examples build their parser from EngineArgs (FlexibleArgumentParser + add_cli_args), pop their own
    flags and hand the rest to LLM(**args); underscores in a flag are taken too. (EngineArgs is at vLLM's other
    path too: nanoserve.engine.arg_utils.)"""
    from nanoserve.engine.arg_utils import EngineArgs as AtVllmsPath
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    assert AtVllmsPath is EngineArgs
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="tiny-qwen3")
    parser.add_argument_group("Sampling parameters").add_argument("--max-tokens", type=int, default=4)
    defaults = vars(parser.parse_args([]))
    assert {k: defaults[k] for k in ("max_model_len", "enable_prefix_caching", "enforce_eager", "seed")} == \
        {"max_model_len": 4096, "enable_prefix_caching": True, "enforce_eager": None, "seed": 0}
    args = vars(parser.parse_args(["--max_model_len", "256", "--no-enable-prefix-caching", "--device=cpu",
                                   "--num-gpu-blocks-override", "64", "--gpu-memory-utilization", "0.5"]))
    max_tokens = args.pop("max_tokens")
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(**args))
    assert (engine_args.max_model_len, engine_args.enable_prefix_caching, engine_args.num_gpu_blocks_override,
            engine_args.gpu_memory_utilization) == (256, False, 64, 0.5)
    with LLM(**args) as llm:
        assert llm.engine.max_model_len == 256
        out = llm.generate("Hello", SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(SystemExit):  # a value of the wrong type is argparse's usage error
        parser.parse_args(["--max-model-len", "lots"])


def test_detokenize_false_gives_token_ids_alone(llm):
    """SamplingParams(detokenize=False), as vLLM's: the same tokens, no text (""), no decoded_token; stop strings,
    which are found in the text, are refused."""
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1, detokenize=False)
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    want = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.token_ids == want.token_ids and want.text
    assert all(lp.decoded_token is None for step in out.logprobs for lp in step.values())
    assert [text for _, text, _, _ in llm.stream("Hello", params)] == [""] * 5
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_spaces_between_special_tokens_goes_to_the_tokenizers_decode(llm):
    """SamplingParams(spaces_between_special_tokens=False), as vLLM's: every decode of the request's text asks the
    tokenizer for it, streamed, with a stop string (token by token) and in one go (transformers' fast tokenizers,
    these models', make no such spaces either way: the text is the same)."""
    tokenizer = llm.get_tokenizer()
    decode, asked = tokenizer.decode, []
    tokenizer.decode = lambda ids, **kwargs: asked.append(kwargs) or decode(ids, **kwargs)
    try:
        for extra in ({}, {"stop": ["zzz"]}):
            for spaces in (True, False):
                asked.clear()
                params = SamplingParams(max_tokens=4, temperature=0, skip_special_tokens=False,
                                        spaces_between_special_tokens=spaces, **extra)
                text = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].text
                streamed = "".join(piece for _, piece, _, _ in llm.stream("Hello", params))
                assert asked and all(a.get("spaces_between_special_tokens", True) is spaces for a in asked), asked
                assert text == streamed and text
    finally:
        del tokenizer.decode
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


def test_metrics_example_counts_what_ran():
    """vLLM's metrics example: LLM(disable_log_stats=False).get_metrics() gives vLLM's metric objects, whose
    values are those of the requests that ran (each checked against the outputs' own counts and times)."""
    from nanoserve.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    with LLM(**MODEL) as plain, pytest.raises(RuntimeError, match="disable_log_stats=False"):
        plain.get_metrics()
    llm = LLM(**MODEL, disable_log_stats=False)
    prompts = PROMPTS + ["The capital of France is Paris. " * 6]  # blocks of 16 tokens: this one fills two
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, stop_token_ids=[220]),
                        use_tqdm=False)
    outs += llm.generate(prompts[-1:], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)  # cached now
    found = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert not any(isinstance(m, Vector) for m in found.values())
    assert all(m.labels["model_name"] == "tiny-qwen3" for m in found.values())
    value = {name: m.value for (name, _), m in found.items() if isinstance(m, (Counter, Gauge)) and _ is None}
    completions = [o.outputs[0] for o in outs]
    assert value["vllm:prompt_tokens"] == value["vllm:prefix_cache_queries"] == sum(
        len(o.prompt_token_ids) for o in outs)
    assert value["vllm:generation_tokens"] == sum(len(c.token_ids) for c in completions)
    assert value["vllm:prefix_cache_hits"] == sum(o.num_cached_tokens for o in outs) > 0
    assert value["vllm:num_requests_running"] == value["vllm:num_requests_waiting"] == 0
    assert value["vllm:kv_cache_usage_perc"] == 0  # every block is free (or cached, which counts as free)
    for reason in ("stop", "length"):
        assert found["vllm:request_success", reason].value == sum(c.finish_reason == reason for c in completions)
    hist = {name: m for (name, _), m in found.items() if isinstance(m, Histogram)}
    assert hist["vllm:time_to_first_token_seconds"].sum == pytest.approx(
        sum(o.metrics.first_token_time - o.metrics.arrival_time for o in outs))
    itl = hist["vllm:inter_token_latency_seconds"]  # each gap between two tokens of one completion
    assert itl.count == sum(len(c.token_ids) - 1 for c in completions)
    assert itl.sum == pytest.approx(sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outs))
    assert hist["vllm:request_generation_tokens"].sum == value["vllm:generation_tokens"]
    for h in hist.values():
        counts = list(h.buckets.values())
        assert list(h.buckets)[-1] == "+Inf" and counts == sorted(counts) and counts[-1] == h.count == len(outs) \
            or h.name == "vllm:inter_token_latency_seconds"
    streamed = [token for _, _, token, _ in llm.stream("Hello", SamplingParams(max_tokens=2)) if token is not None]
    assert {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}[
        "vllm:generation_tokens", None].value == value["vllm:generation_tokens"] + len(streamed)


def is_engine_step(name: str) -> bool:
    """A trace's event for one call of the engine's step (torch's profiler names Python calls `file(line): name`)."""
    return "nanoserve/engine/llm_engine.py(" in name and name.endswith(": step")


def test_profiling_example_writes_a_chrome_trace(tmp_path, monkeypatch):
    """vLLM's simple_profiling example (its older VLLM_TORCH_PROFILER_DIR, and profiler_config): the trace of
    the steps between start_profile and stop_profile, in Chrome's JSON; misuse is an error that says so."""
    import glob
    import gzip

    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    llm = LLM(**MODEL)
    with pytest.raises(RuntimeError, match="no profile was started"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3), use_tqdm=False)
    llm.stop_profile()
    trace, = glob.glob(str(tmp_path / "env" / "nanoserve_rank0.*.pt.trace.json.gz"))
    names = [e.get("name", "") for e in json.load(gzip.open(trace))["traceEvents"]]
    assert sum(is_engine_step(n) for n in names) == 3  # one prefill step (four prompts) and two decode steps
    assert "Self CPU" in (tmp_path / "env" / "profiler_out_0.txt").read_text()
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    with pytest.raises(RuntimeError, match="no profiler is configured"):
        LLM(**MODEL).start_profile()
    # profiler_config, as vLLM 0.33's example and run_one_batch.py give it: skip one step, then record two
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "cfg"), "torch_profiler_use_gzip": False,
              "torch_profiler_dump_cuda_time_total": False, "delay_iterations": 1, "max_iterations": 2}
    llm = LLM(**MODEL, profiler_config=config)
    llm.start_profile(profile_prefix="mine")
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6), use_tqdm=False)
    assert "step" not in vars(llm.engine)  # max_iterations ended it: the engine's own step is back
    llm.stop_profile()
    trace, = glob.glob(str(tmp_path / "cfg" / "mine_rank0.*.pt.trace.json"))
    assert sum(is_engine_step(e.get("name", "")) for e in json.load(open(trace))["traceEvents"]) == 2
    assert sorted(p.name for p in (tmp_path / "cfg").iterdir()) == [Path(trace).name]
    for bad, says in [({"profiler": "torch"}, "needs torch_profiler_dir"), ({"profiler": "nsys"}, "'torch' or 'cuda'"),
                      ({**config, "ignore_frontend": True}, "ignore_frontend"), ({"profile": "torch"}, "unknown")]:
        with pytest.raises(ValueError, match=says):
            EngineArgs(model="tiny-qwen3", profiler_config=bad)


def test_run_one_batch_example_profiles_the_prefill(tmp_path):
    """vLLM's run_one_batch.py: EngineArgs' flags, nanoserve.config.ProfilerConfig, min_tokens = max_tokens."""
    from nanoserve.config import ProfilerConfig
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="tiny-qwen3")
    args = vars(parser.parse_args(["--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64"]))
    args["profiler_config"] = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path), max_iterations=1)
    llm = LLM(**args)
    params = llm.get_default_sampling_params()
    params.max_tokens = params.min_tokens = 16
    params.ignore_eos = True
    llm.start_profile()
    outs = llm.generate(["Hello, my name is" * 4] * 2, params, use_tqdm=False)
    llm.stop_profile()
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]
    assert len(list(tmp_path.glob("nanoserve_rank0.*.pt.trace.json.gz"))) == 1
    parsed = parser.parse_args(["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "x"}'])
    assert EngineArgs.from_cli_args(parsed).profiler_config.torch_profiler_dir == str(Path("x").resolve())


def test_llm_engine_reset_kv_example():
    """vLLM's llm_engine_reset_kv.py: `from nanoserve import LLMEngine`, requests added by id and stepped, the prefix
    cache reset mid-run with reset_running_requests (the running request is recomputed: the same greedy text)."""
    from nanoserve import LLMEngine, RequestOutput
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "tiny-qwen3", "--device", "cpu", "--max-model-len", "256",
                              "--num-gpu-blocks-override", "64"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16, ignore_eos=True)
    prompts, finished, step, moved = [("A robot may not injure a human being", params)] * 2, [], 0, []
    while prompts or engine.has_unfinished_requests():
        if prompts:
            engine.add_request(str(len(prompts)), *prompts.pop(0))
        if step == 10:
            assert engine.reset_prefix_cache() is False  # requests hold blocks
            assert engine.reset_prefix_cache(reset_running_requests=True) is True
        outputs: list[RequestOutput] = engine.step()
        moved += outputs
        finished += [o for o in outputs if o.finished]
        step += 1
    want = LLM(**MODEL).generate("A robot may not injure a human being", params, use_tqdm=False)[0]
    assert sorted(o.request_id for o in finished) == ["1", "2"]
    for out in finished:
        assert out.outputs[0].token_ids == want.outputs[0].token_ids and out.outputs[0].text == want.outputs[0].text
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and len(out.outputs[0].logprobs) == 16
    partial = [o for o in moved if not o.finished]
    assert partial and all(want.outputs[0].text.startswith(o.outputs[0].text) for o in partial)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("3", "x", params) or engine.add_request("3", "x", params)


def test_llm_engine_steps_on_after_a_ctrl_c_in_a_step():
    """A Ctrl-C in the middle of a step (between two sequences' tokens) of vLLM's LLMEngine: stepping on finishes
    every request with the tokens of a run never interrupted, the one that finished in that very step included
    (its last token had been handed out before the step stopped)."""
    from nanoserve import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**MODEL))
    short, long = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 12))
    engine.add_request("short", "A robot may not injure a human being", short)
    engine.add_request("long", "A robot may not injure a human being", long)
    inner, original, interrupted = engine.llm.engine, engine.llm.engine.update, []

    def update(seq, *args):  # the long request's row, in the step whose earlier row finished the short one
        if seq.params.max_tokens == 12 and not interrupted and any(
                s.params.max_tokens == 5 and s.finish_reason for s in inner.step_seqs):
            interrupted.append(seq)
            raise KeyboardInterrupt
        return original(seq, *args)
    inner.update = update
    finished, steps = {}, 0
    while engine.has_unfinished_requests() and steps < 40:
        steps += 1
        try:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        except KeyboardInterrupt:
            pass
    assert interrupted and sorted(finished) == ["long", "short"]
    llm = LLM(**MODEL)
    for name, params in (("short", short), ("long", long)):
        want = llm.generate("A robot may not injure a human being", params, use_tqdm=False)[0].outputs[0]
        assert finished[name].outputs[0].token_ids == want.token_ids, name


def test_prefix_caching_example_frees_the_first_llm_between_two():
    """vLLM's prefix_caching example: `del llm; cleanup_dist_env_and_memory()` before the second LLM."""
    import weakref

    from nanoserve.distributed import cleanup_dist_env_and_memory

    llm = LLM(**MODEL)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    model = weakref.ref(llm.model)
    del llm
    cleanup_dist_env_and_memory()
    assert model() is None


def test_what_nanoserve_does_not_do_is_refused_by_name():
    """LoRA, pooling models, YaRN's longer context...: an error naming the feature, never a setting ignored."""
    for setting, says in [("enable_lora", "LoRA"), ("runner", "pooling"),
                          ("hf_overrides", "overriding the checkpoint's config")]:
        with pytest.raises(TypeError, match=f"{setting} \\({says}"):
            LLM("tiny-qwen3", **{setting: True})
    with LLM(**MODEL) as llm:
        for method in ("embed", "classify", "score", "reward", "encode"):
            with pytest.raises(AttributeError, match=f"LLM.{method}: pooling models"):
                getattr(llm, method)
        for method in ("sleep", "wake_up"):
            with pytest.raises(AttributeError, match=f"LLM.{method}: sleep mode is not supported"):
                getattr(llm, method)()


def test_generate_takes_vllms_older_prompt_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=3)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)]
    older = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in older] == want and older[1].prompt_token_ids == [4, 5]
    one = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=params, use_tqdm=False)  # one prompt's ids
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[0]
    for both_or_neither in (dict(prompts=["x"], prompt_token_ids=[1]), dict()):
        with pytest.raises(TypeError, match="prompt_token_ids"):
            llm.generate(**both_or_neither)

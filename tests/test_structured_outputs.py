"""Structured outputs: the output follows its JSON schema, regex, choice or grammar, whatever the
model would rather say (a random model, sampled at temperature 1), alone or in a batch, with async scheduling
and n > 1; through LLM, lesson 02's loop and the server's response_format / structured_outputs / guided_*."""
import json
import re
import threading

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.course.generate import generate
from nanoserve.serve.api_server import build_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = [
    (StructuredOutputsParams(json=SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    (StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{2}"), lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text)),
    (StructuredOutputsParams(choice=["yes", "no", 'say "hi"']), lambda text: text in ("yes", "no", 'say "hi"')),
    (StructuredOutputsParams(grammar='start: term ("+" term)? "="\nterm: "x" | "(" "y" ")"'),
     lambda text: re.fullmatch(r"(x|\(y\))(\+(x|\(y\)))?=", text)),
    (StructuredOutputsParams(grammar='root ::= "0" | [1-9] [0-9]? [0-9]?'), lambda text: re.fullmatch(r"0|[1-9][0-9]{0,2}", text)),
    (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", device="cpu", max_model_len=512, num_gpu_blocks_override=128) as llm:
        yield llm


@pytest.mark.parametrize("ahead", [False, True])
def test_every_output_follows_its_constraint_alone_and_in_a_batch(llm, ahead):
    llm.engine.async_scheduling = ahead
    try:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, n=2, structured_outputs=so)
                  for i, (so, _) in enumerate(CONSTRAINTS)]
        free = SamplingParams(temperature=1.0, seed=9, max_tokens=12)
        batch = llm.generate(["Tell me about it."] * len(params) + ["Free text"], params + [free], use_tqdm=False)
        for (so, valid), out in zip(CONSTRAINTS, batch):
            for completion in out.outputs:
                assert completion.finish_reason == "stop" and valid(completion.text), (so, completion.text)
        for i, p in enumerate(params[:3]):  # a request's tokens do not depend on its batch-mates
            alone = llm.generate(["Tell me about it."], p, use_tqdm=False)[0]
            assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batch[i].outputs]
        unconstrained = llm.generate(["Free text"], free, use_tqdm=False)[0].outputs[0]
        assert batch[-1].outputs[0].token_ids == unconstrained.token_ids
    finally:
        llm.engine.async_scheduling = False



@pytest.mark.parametrize("spec", [CONSTRAINTS[0][0], CONSTRAINTS[1][0]], ids=["json", "regex"])
def test_async_scheduling_stays_on_for_a_structured_request(llm, spec):
    """With async scheduling every step of a structured request is launched ahead, while the step before
    still runs (only its draw waits for the grammar's mask): it never sits a step out, and its tokens are
    those of the synchronous engine."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=spec)
    engine = llm.engine
    sync = llm.generate(["Tell me about it."], params, use_tqdm=False)[0].outputs[0]
    masks = engine.runner.processors.processor("structured_outputs")
    fill, filled_by = masks.fill, []
    masks.fill = lambda *args: filled_by.append(threading.current_thread().name) or fill(*args)
    engine.async_scheduling = True
    try:
        before = (engine.stats.steps, engine.stats.steps_ahead)
        ahead = llm.generate(["Tell me about it."], params, use_tqdm=False)[0].outputs[0]
        steps, launched_ahead = engine.stats.steps - before[0], engine.stats.steps_ahead - before[1]
    finally:
        engine.async_scheduling = False
        del masks.fill
    assert ahead.token_ids == sync.token_ids
    assert len(ahead.token_ids) > 3 and steps <= len(ahead.token_ids) + 1  # a step per token (no step sat out)
    assert launched_ahead >= len(ahead.token_ids) - 2, (launched_ahead, len(ahead.token_ids))
    # the masks were filled ahead, in the filler thread, while the engine handed out the step before's tokens
    # and scheduled (all but the first two); maybe once more, for a step launched before its last token was
    # known to be the last
    assert len(ahead.token_ids) <= len(filled_by) <= len(ahead.token_ids) + 1, (len(filled_by), len(ahead.token_ids))
    assert sum(name.startswith("grammar-masks") for name in filled_by) >= len(ahead.token_ids) - 2, filled_by

@pytest.mark.parametrize("where", ["schedule", "update"])
def test_ctrl_c_while_masks_fill_ahead_leaves_later_outputs_unchanged(llm, where):
    """With async scheduling a grammar's masks are filled in a thread of their own while the engine schedules
    the next step. A Ctrl-C there (the fill left running), or while a step's tokens are taken, leaves every
    matcher where its output is: the same requests, run again, give the same tokens."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, n=2, structured_outputs=so)
              for i, (so, _) in enumerate(CONSTRAINTS)] + [SamplingParams(temperature=1.0, seed=7, max_tokens=20)]
    prompts = ["Tell me about it."] * len(params)
    engine = llm.engine
    owner = engine.scheduler if where == "schedule" else engine

    def tokens():
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    engine.async_scheduling = True
    try:
        clean = tokens()
        for on_call in (3, 8, 20):
            calls, original = [0], getattr(owner, where)

            def interrupted(*args, **kwargs):
                calls[0] += 1
                if calls[0] == on_call:
                    raise KeyboardInterrupt
                return original(*args, **kwargs)
            setattr(owner, where, interrupted)
            try:
                with pytest.raises(KeyboardInterrupt):
                    tokens()
            finally:
                delattr(owner, where)
            assert engine.in_flight is None and not engine.has_unfinished()
            assert tokens() == clean, (where, on_call)
    finally:
        engine.async_scheduling = False


@pytest.mark.parametrize("on_call", [1, 2, 3])
def test_a_stream_keeps_its_grammar_through_another_calls_ctrl_c(llm, on_call):
    """Each step's tokens are taken by every grammar's matcher at once, before the engine hands them to their
    sequences one by one. A Ctrl-C in between, in another call (a generate call of the same LLM), leaves a
    stream's sequence running: a token the step had not handed it yet is drawn again (its matcher gives it
    back, or the stream goes on from a state one token ahead), and one it had is still the stream's to read."""
    so = StructuredOutputsParams(regex=r"[a-c]{2,30}-[0-9]{2,30}")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=50, structured_outputs=so)
    clean = [item[2] for item in llm.stream(["Tell me about it."], params)]
    engine = llm.engine
    engine.async_scheduling = True
    try:
        stream = llm.stream(["Tell me about it."], params)
        got = [next(stream)[2] for _ in range(3)]
        calls, original = [0], engine.update

        def interrupted(seq, *args):
            calls[0] += 1
            if calls[0] == on_call:
                raise KeyboardInterrupt
            return original(seq, *args)
        engine.update = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):  # its sequences decode beside the stream's, longest first
                llm.generate(["One two three four five six seven"] * 2,
                             SamplingParams(temperature=1.0, seed=2, max_tokens=20), use_tqdm=False)
        finally:
            del engine.update
        got += [item[2] for item in stream]
    finally:
        engine.async_scheduling = False
    assert got == clean


@pytest.mark.parametrize("row", [0, 1, 2])
def test_stepping_on_after_a_ctrl_c_midway_through_a_steps_tokens_keeps_every_grammar(llm, row):
    """With async scheduling the next step's masks start filling as soon as the matchers took a step's tokens,
    before the engine hands the tokens out. A Ctrl-C in between (at a row of the step), then stepping on with the
    same requests (vLLM's LLMEngine.step, say): the tokens not handed out are drawn again, from masks of the
    matchers' state before them, and every output is that of a run never interrupted."""
    engine = llm.engine
    so = [StructuredOutputsParams(regex=r"[a-c]{2,30}-[0-9]{2,30}"), StructuredOutputsParams(json=SCHEMA),
          StructuredOutputsParams(regex=r"(yes|no|maybe) [a-z]{3,20}")]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=s) for i, s in enumerate(so)]

    def run(interrupt_at=None):
        seqs = [engine.add_request(llm.tokenizer.encode("Tell me about it."), p) for p in params]
        calls, original = [0], engine.update

        def update(seq, *args):
            calls[0] += 1
            if calls[0] == interrupt_at:
                raise KeyboardInterrupt
            return original(seq, *args)
        engine.update, interrupted = update, 0
        try:
            while engine.has_unfinished():
                try:
                    engine.step()
                except KeyboardInterrupt:
                    interrupted += 1
        finally:
            del engine.update
        assert interrupted == (interrupt_at is not None)
        return [seq.output_ids for seq in seqs]
    engine.async_scheduling = True
    try:
        clean = run()
        assert run(interrupt_at=3 * 6 + row + 1) == clean  # in the 7th decode step, at row `row`
    finally:
        engine.async_scheduling = False


class InterruptedExecutor:
    """llguidance's executor, but its `on_call`th consume_token_par is followed by a Ctrl-C (as Python raises one
    that came while llguidance ran: once it returns)."""

    def __init__(self, executor, on_call: int):
        self.executor, self.calls, self.on_call = executor, 0, on_call

    def consume_token_par(self, pairs):
        answers = self.executor.consume_token_par(pairs)
        self.calls += 1
        if self.calls == self.on_call:
            raise KeyboardInterrupt
        return answers

    def __getattr__(self, name):
        return getattr(self.executor, name)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_ctrl_c_as_the_matchers_take_a_steps_tokens_gives_them_back(llm, ahead):
    """A Ctrl-C while llguidance's threads take a step's tokens is raised once they took them: stepping on, each
    matcher gives its token back, and every output is that of a run never interrupted."""
    engine = llm.engine
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=so)
              for i, so in enumerate([StructuredOutputsParams(regex=r"[a-c]{2,30}-[0-9]{2,30}"),
                                      StructuredOutputsParams(json=SCHEMA)])]

    def run():
        seqs = [engine.add_request(llm.tokenizer.encode("Tell me about it."), p) for p in params]
        interrupted = 0
        while engine.has_unfinished():
            try:
                engine.step()
            except KeyboardInterrupt:
                interrupted += 1
        return [seq.output_ids for seq in seqs], interrupted
    engine.async_scheduling = ahead
    try:
        clean, _ = run()
        masks = engine.runner.processors.processor("structured_outputs")
        masks.executor = InterruptedExecutor(masks.executor, on_call=5)
        try:
            again, interrupted = run()
        finally:
            masks.executor = masks.executor.executor
        assert interrupted == 1 and again == clean
    finally:
        engine.async_scheduling = False


def test_lesson_02s_loop_follows_a_constraint_too(llm):
    done, _ = generate(llm.model, [[5, 6, 7]], SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                                structured_outputs=StructuredOutputsParams(
                                                                    choice=["left", "right"])),
                       eos_token_ids=llm.eos_token_ids, tokenizer=llm.tokenizer)
    assert done[0].text in ("left", "right") and done[0].finish_reason == "stop"


@pytest.mark.parametrize("bad, match", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(choice="ab"), "choice"),
    (dict(json=3), "json"), (dict(json_object=1), "exactly one")])
def test_malformed_constraints_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_a_constraint_that_does_not_compile_fails_its_request_alone(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                                     SamplingParams(max_tokens=3)], use_tqdm=False)
    assert outs[0].error and "structured_outputs" in outs[0].error and not outs[1].error


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(llm, "tiny-qwen3")) as client:
        yield client


def test_the_openai_client_gets_schema_valid_json_and_choices(client):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    chat = api.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "Who are you?"}], temperature=1.0, seed=1,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    for extra in ({"structured_outputs": {"choice": ["red", "blue"]}}, {"guided_choice": ["red", "blue"]}):
        reply = api.completions.create(model="tiny-qwen3", prompt="Pick:", max_tokens=20, temperature=1.0,
                                       extra_body=extra)
        assert reply.choices[0].text in ("red", "blue")
    reply = api.completions.create(model="tiny-qwen3", prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
                                   extra_body={"guided_regex": "[A-Z]{3}[0-9]"})
    assert re.fullmatch("[A-Z]{3}[0-9]", reply.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs"),
    ({"guided_regex": "(", "max_tokens": 2}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_the_server_refuses_what_it_cannot_follow_by_name(client, body, param):
    reply = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "messages": [
        {"role": "user", "content": "Hi"}], **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice, parallel", [("required", None), ("required", False),
                                              ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_a_required_tool_call_parses_and_follows_the_tools_schema(client, choice, parallel):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = api.chat.completions.create(model="tiny-qwen3", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                        temperature=1.0, seed=6, max_tokens=200, **extra)
    choice_ = reply.choices[0]
    assert choice_.message.tool_calls, choice_
    # a random model may go on calling until max_tokens when several calls are allowed
    assert choice_.finish_reason == "tool_calls" or (parallel is None and choice_.finish_reason == "length")
    if parallel is False:
        assert len(choice_.message.tool_calls) == 1 and choice_.message.content is None
    for call in choice_.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "get_time"


PLAN = {"type": "function", "function": {"name": "plan", "parameters": {  # pydantic's shape for nested models
    "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "maxItems": 2},
                                     "owner": {"$ref": "#/$defs/Name"}},
    "required": ["steps", "owner"], "additionalProperties": False,
    "$defs": {"Step": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "by": {"$ref": "#/$defs/Name"}},
                       "required": ["n", "by"], "additionalProperties": False},
              "Name": {"type": "string", "maxLength": 5}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan"}}])
def test_a_required_tool_call_follows_a_schema_with_defs_and_refs(client, choice):
    """The references of a tool's schema point into its own $defs: the call's arguments follow them."""
    reply = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "messages": ASK, "tools": [WEATHER, PLAN],
                                                      "tool_choice": choice, "parallel_tool_calls": False,
                                                      "temperature": 1.0, "seed": 3, "max_tokens": 150})
    assert reply.status_code == 200, reply.text
    choice_ = reply.json()["choices"][0]
    assert choice_["finish_reason"] == "tool_calls", choice_
    (call,) = choice_["message"]["tool_calls"]
    tool = {"get_weather": WEATHER, "plan": PLAN}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert call["function"]["name"] == "plan"


def test_a_conversation_with_tool_calls_and_tool_results_is_rendered(client, llm):
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "messages": turns, "tools": [WEATHER],
                                                      "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text
    for turn in turns:
        turn["content"] = turn["content"] or ""
    ids = llm.tokenizer.apply_chat_template(turns, tools=[WEATHER], add_generation_prompt=True, tokenize=True,
                                            enable_thinking=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)


def test_auto_tool_calls_are_parsed_out_of_the_text():
    from nanoserve.serve.protocol import parse_tool_calls
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len(parse_tool_calls(text, parallel=False)[1]) == 1
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_tool_requests_that_cannot_be_served_are_refused_by_name(client, body, param):
    reply = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "messages": ASK, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_outputs_follow_separately_compiled_matchers_compiled_off_the_callers_thread(llm, monkeypatch):
    """A step's masks are filled side by side only for separately compiled matchers: CompiledGrammar hands out
    copies of up to MASK_THREADS of them in turn. The extra ones compile in a thread of their own, from the moment
    the constraint is compiled, so a grammar that is slow to compile never stalls the caller (the step loop);
    every copy follows the grammar."""
    import threading
    import time

    import llguidance

    from nanoserve.features import structured_outputs as so

    monkeypatch.setattr(so, "MASK_THREADS", 3)
    compiled_in = []
    real = llguidance.LLMatcher

    def recording(*args, **kwargs):  # llguidance.LLMatcher, noting the thread that compiles
        compiled_in.append(threading.current_thread())
        return real(*args, **kwargs)
    for name in ("grammar_from_regex", "validate_grammar"):  # its static methods, used as the grammar compiles
        setattr(recording, name, getattr(real, name))

    spec = StructuredOutputsParams(regex="(ab){1,40}c")
    monkeypatch.setattr(llguidance, "LLMatcher", recording)
    grammar = so.compiled_grammar(llm.tokenizer, spec)  # compiled and checked here, as a server's thread does
    deadline = time.monotonic() + 30
    while len(grammar.bases) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    matchers = [grammar.matcher() for _ in range(7)]
    assert len(grammar.bases) == 3 and len(compiled_in) == 3  # at most MASK_THREADS, each compiled once
    assert compiled_in[0] is threading.current_thread() and threading.current_thread() not in compiled_in[1:]
    ab = llm.tokenizer.encode("ab")
    for m in matchers:  # each a fresh follower of the same grammar
        assert all(m.consume_token(t) for t in ab) and not m.is_error()


def test_a_burst_with_a_new_constraint_gets_copies_of_every_compiled_matcher(llm, monkeypatch):
    """Requests that come together with a constraint not seen before: its other compiled matchers are still
    compiling when the last of them is added. Each gets its copy when it first joins a draw, by then from every
    compiled matcher in turn (copies of the first alone are filled one after another), and follows the grammar."""
    import time

    from nanoserve.engine.request import prepare
    from nanoserve.features import structured_outputs as so

    monkeypatch.setattr(so, "MASK_THREADS", 4)
    compile_rest, release = so.CompiledGrammar._compile_the_rest, threading.Event()
    # the other matchers compile only once the whole burst is in, as on a machine where they compile slowly
    monkeypatch.setattr(so.CompiledGrammar, "_compile_the_rest", lambda self: release.wait(30) and compile_rest(self))
    spec = StructuredOutputsParams(regex="(xy|z){2,9}!")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=spec) for i in range(8)]
    bases_seen, matcher = [], so.CompiledGrammar.matcher

    def handing_out(self):
        bases_seen.append(len(self.bases))
        return matcher(self)
    monkeypatch.setattr(so.CompiledGrammar, "matcher", handing_out)
    engine, step = llm.engine, llm.engine.step

    def first_step():  # every request is in: let the other matchers compile, and wait for them
        release.set()
        grammar, deadline = prepare(params[0], llm.get_tokenizer()).grammar, time.monotonic() + 30
        while len(grammar.bases) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.step = step
        return step()
    engine.step = first_step
    try:
        outputs = llm.generate(["Tell me about it."] * 8, params, use_tqdm=False)
    finally:
        engine.step = step
    assert bases_seen == [4] * 8, bases_seen
    for out in outputs:
        assert re.fullmatch(r"(xy|z){2,9}!", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("regex", [r"[a-z ]{1,2000}", r"\d{3}-\d{4}", r"[A-Z][a-z]+( [A-Z][a-z]+)*",
                                   r"(yes|no) [^\n]{0,40}\.", r"\w+@[a-z]+\.(com|org)"])
def test_a_regexs_own_slices_give_the_same_masks(llm, regex):
    """Slices made of a regex's classes only speed its masks up: along a random path of allowed tokens, each mask
    equals the default slices' one."""
    import random

    import llguidance
    import numpy as np
    from nanoserve.features.structured_outputs import compiled_grammar, ll_tokenizer, regex_slices

    slices, tok = regex_slices(regex), llm.get_tokenizer()
    assert slices, "every regex here repeats a class"
    assert compiled_grammar(tok, StructuredOutputsParams(regex=regex)).ll is ll_tokenizer(tok, slices)
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    plain, sliced = (llguidance.LLMatcher(ll_tokenizer(tok, s), grammar, log_level=0) for s in (None, slices))
    rng = random.Random(regex)
    for _ in range(12):
        masks = [np.frombuffer(m.compute_bitmask(), dtype=np.uint32) for m in (plain, sliced)]
        assert np.array_equal(*masks)
        allowed = np.flatnonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little"))
        token = int(rng.choice(list(allowed)))
        if plain.is_stopped() or not all(m.consume_token(token) for m in (plain, sliced)):
            break

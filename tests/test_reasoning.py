"""vLLM's --reasoning-parser qwen3 on the server: a chat answer's <think> ... </think> goes to message.reasoning
(and reasoning_content), the rest to content, whole and streamed, with n > 1; include_reasoning: false leaves the
thinking out; thinking_token_budget ends the thinking after that many tokens; a required tool call or a JSON
schema applies to the answer after </think>. A fake reasoning model (a logits processor that writes a script)
makes the split exact to the letter; tiny-qwen3 (random weights, Qwen3's tokenizer and template) shows the
template's side, the budget and the constraints. Without the flag nothing changes."""
import json

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from nanoserve import LLM
from nanoserve.features.processors import LogitsProcessor
from nanoserve.serve.api_server import build_app
from nanoserve.serve.reasoning import Qwen3Reasoning, ReasoningText

MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "What is 1+1?"}]
# what the fake model writes, completion by completion (index i: SCRIPTS[i]); a marker may come in pieces
SCRIPTS = [("<think>", "Two ones", " make two.", "</think>", "\n\nIt is ", "2."),
           ("<think>", "Add", " them", "</think>", "2")]


class Scripted(LogitsProcessor):
    """Every request's completion i writes SCRIPTS[i], token by token, then ends (<|im_end|>)."""
    ids: list[list[int]] = []  # SCRIPTS tokenised (set by the fixture)

    @classmethod
    def wanted(cls, params) -> bool:
        return True

    def apply(self, logits: torch.Tensor, rows) -> None:
        for row, seq, step in zip(rows.index.tolist(), rows.seqs, rows.steps):
            script = self.ids[seq.index % len(self.ids)]
            logits[row] = float("-inf")
            logits[row, script[step] if step < len(script) else self.eos] = 0.0


@pytest.fixture(scope="module")
def fake():
    with LLM(MODEL, device="cpu", max_model_len=512, num_gpu_blocks_override=64, logits_processors=[Scripted]) as llm:
        tokenizer = llm.tokenizer
        Scripted.ids = [[t for piece in script for t in tokenizer.encode(piece)] for script in SCRIPTS]
        Scripted.eos, Scripted.end = tokenizer.convert_tokens_to_ids(["<|im_end|>", "</think>"])
        with TestClient(build_app(llm, MODEL, reasoning_parser="qwen3")) as client:
            yield client


@pytest.fixture(scope="module")
def tiny():
    with LLM(MODEL, device="cpu", max_model_len=512, num_gpu_blocks_override=96) as llm:
        yield llm


def api(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)


def streamed(client, **kwargs) -> tuple[dict, dict, list]:
    """A streamed chat's reasoning and content, joined per choice, and its chunks."""
    chunks = list(api(client).chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs))
    reasoning, content = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning[c.index] = reasoning.get(c.index, "") + (extra.get("reasoning") or "")
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    return reasoning, content, chunks


def test_the_fake_models_thinking_and_answer_come_apart_whole_and_streamed(fake):
    want = [("Two ones make two.", "\n\nIt is 2."), ("Add them", "2")]
    whole = api(fake).chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=40)
    got = [(c.message.model_extra["reasoning"], c.message.content) for c in whole.choices]
    assert got == want and [c.message.model_extra["reasoning_content"] for c in whole.choices] == [w[0] for w in want]
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
    thinking = sum(ids.index(Scripted.end) + 1 for ids in Scripted.ids)  # its markers included
    assert whole.usage.completion_tokens_details.reasoning_tokens == thinking
    reasoning, content, _ = streamed(fake, n=2, max_tokens=40)
    assert [(reasoning[i], content[i]) for i in (0, 1)] == want

    hidden = api(fake).chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=40,
                                               extra_body={"include_reasoning": False})
    assert [(c.message.model_extra.get("reasoning"), c.message.content) for c in hidden.choices] == \
        [(None, w[1]) for w in want]
    reasoning, content, _ = streamed(fake, n=2, max_tokens=40, extra_body={"include_reasoning": False})
    assert [(reasoning[i], content[i]) for i in (0, 1)] == [("", w[1]) for w in want]

    cut = api(fake).chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)  # stopped while thinking
    assert (cut.choices[0].message.model_extra["reasoning"], cut.choices[0].message.content) == ("Two ones", None)


def test_the_split_holds_back_a_marker_that_comes_in_pieces(tiny):
    parser = Qwen3Reasoning(tiny.tokenizer)
    text = "<think>Hm, </thi is not it.</think>So: <think> stays."
    for cut in range(len(text) + 1):  # every place a piece can end; each as a whole, and fed letter by letter
        split = ReasoningText(parser, thinking=False)
        parts = [split.feed(text[:cut]), split.feed(text[cut:], last=True)]
        assert tuple("".join(p[k] for p in parts) for k in (0, 1)) == ("Hm, </thi is not it.", "So: <think> stays.")
    split = ReasoningText(parser, thinking=True)
    assert split.feed("no markers at all", last=True) == ("no markers at all", "")


def test_the_template_says_whether_the_output_begins_thinking(tiny):
    parser, tokenizer = Qwen3Reasoning(tiny.tokenizer), tiny.tokenizer
    for on in (True, False):
        prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=on, tokenize=False)
        assert parser.thinks_first(tokenizer.encode(prompt)) is on
    with pytest.raises(ValueError, match="reasoning_parser"):
        build_app(tiny, MODEL, reasoning_parser="deepseek_r1")


def test_thinking_off_or_no_parser_leaves_the_answer_as_it_was(tiny):
    """With enable_thinking false the parser passes the answer through untouched: the same content as a server
    without the parser gives; without the parser, the reasoning fields it alone takes are refused by name."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 4, "n": 2}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with TestClient(build_app(tiny, MODEL)) as plain, \
            TestClient(build_app(tiny, MODEL, reasoning_parser="qwen3")) as rp:
        before = plain.post("/v1/chat/completions", json=body).json()
        after = rp.post("/v1/chat/completions", json={**body, **off}).json()
        assert [c["message"]["content"] for c in after["choices"]] == \
            [c["message"]["content"] for c in before["choices"]]
        assert all(c["message"]["reasoning"] is None for c in after["choices"])
        assert after["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        thinking = rp.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert thinking["content"] is None and thinking["reasoning"]  # (a random model never closes it)
        for extra, param in [({"thinking_token_budget": 3}, "thinking_token_budget"),
                             ({"include_reasoning": False}, "include_reasoning")]:
            reply = plain.post("/v1/chat/completions", json={**body, **extra})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def thought_ids(parser: Qwen3Reasoning, prompt_ids: list[int], output_ids: list[int]) -> tuple[list, list]:
    """The output's thinking tokens (after the last <think>, before the first </think>) and its answer's."""
    ids = prompt_ids + output_ids
    start = len(ids) - ids[::-1].index(parser.start_id) if parser.start_id in ids else len(prompt_ids)
    end = ids.index(parser.end_id, start)
    return ids[start:end], ids[end + 1:]


@pytest.mark.parametrize("budget", [0, 5])
def test_a_thinking_budget_ends_the_thinking_after_that_many_tokens(tiny, budget):
    parser = Qwen3Reasoning(tiny.tokenizer)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 2, "n": 2,
            "thinking_token_budget": budget, "return_token_ids": True, "ignore_eos": True}
    with TestClient(build_app(tiny, MODEL, reasoning_parser="qwen3")) as client:
        reply = client.post("/v1/chat/completions", json=body).json()
        prompt_ids = reply["prompt_token_ids"]
        for c in reply["choices"]:
            thought, answer = thought_ids(parser, prompt_ids, c["token_ids"])
            assert len(thought) == budget and len(answer) > 0
            decode = tiny.tokenizer.decode
            assert (c["message"]["reasoning"] or "", c["message"]["content"]) == (decode(thought), decode(answer))
        extra = {k: body[k] for k in ("thinking_token_budget", "return_token_ids", "ignore_eos")}
        reasoning, content, chunks = streamed(client, max_tokens=12, temperature=1.0, seed=2, n=2, extra_body=extra)
        ids = {0: [], 1: []}
        for chunk in chunks:
            for c in chunk.choices:
                ids[c.index] += c.model_extra.get("token_ids") or []
        assert [ids[0], ids[1]] == [c["token_ids"] for c in reply["choices"]]  # the same seed: the same tokens
        assert [(reasoning[i] or None, content[i]) for i in (0, 1)] == \
            [(c["message"]["reasoning"], c["message"]["content"]) for c in reply["choices"]]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_schemas_apply_to_the_answer_after_the_thinking(tiny, stream):
    parser = Qwen3Reasoning(tiny.tokenizer)
    common = dict(model=MODEL, messages=ASK, temperature=1.0, seed=5, max_tokens=120, n=2, stream=stream,
                  extra_body={"thinking_token_budget": 4})
    with TestClient(build_app(tiny, MODEL, reasoning_parser="qwen3")) as client:
        calls = api(client).chat.completions.create(tools=[WEATHER], tool_choice="required", **common)
        schema = api(client).chat.completions.create(
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}, **common)
        if stream:
            calls, schema = list(calls), list(schema)
            tool_calls = {i: [tc for ch in calls for c in ch.choices if c.index == i for tc in c.delta.tool_calls or []]
                          for i in (0, 1)}
            answers = {i: "".join(c.delta.content or "" for ch in schema for c in ch.choices if c.index == i)
                       for i in (0, 1)}
            thoughts = {i: "".join((c.delta.model_extra or {}).get("reasoning") or "" for ch in calls
                                   for c in ch.choices if c.index == i) for i in (0, 1)}
        else:
            tool_calls = {c.index: c.message.tool_calls for c in calls.choices}
            answers = {c.index: c.message.content for c in schema.choices}
            thoughts = {c.index: c.message.model_extra["reasoning"] for c in calls.choices}
        for i in (0, 1):
            assert tool_calls[i] and all(tc.function.name == "get_weather" for tc in tool_calls[i])
            for tc in tool_calls[i]:
                jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])
            jsonschema.validate(json.loads(answers[i]), ANSWER)
            assert thoughts[i]


def test_serve_takes_vllms_flag(monkeypatch):
    from nanoserve.cli import main
    from nanoserve.serve import api_server
    served = {}
    monkeypatch.setattr(api_server, "serve", lambda llm, name, *a, **kw: served.update(kw))
    flags = ["serve", MODEL, "--device", "cpu", "--num-gpu-blocks-override", "16", "--reasoning-parser"]
    assert main([*flags, "qwen3"]) == 0 and served["reasoning_parser"] == "qwen3"
    assert main([*flags, "deepseek_r1"]) == 2

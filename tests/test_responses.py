"""POST /v1/responses through OpenAI's own client: text in (a string, or messages with text parts), instructions,
max_output_tokens, temperature, the answer as output items and output_text, whole and streamed as the SDK's
events; function tools, and their results sent back as function_call_output items; a reasoning model's
thinking as a reasoning item; and what would need storage refused by name."""
import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from test_reasoning import Scripted

from nanoserve import LLM
from nanoserve.serve.api_server import build_app

MODEL = "tiny-qwen3"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, device="cpu", max_model_len=512, num_gpu_blocks_override=96) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(llm, MODEL)) as client:
        yield client


def api(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)


def chat(client, messages: list, **body) -> dict:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **body}).json()


def test_text_in_and_out_is_the_chat_it_stands_for_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = chat(client, messages, max_tokens=8, temperature=0)
    reply = api(client).responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.",
                                         max_output_tokens=8, temperature=0)
    assert reply.output_text == want["choices"][0]["message"]["content"] and reply.output[0].type == "message"
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"  # 8 tokens
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (want["usage"]["prompt_tokens"], 8)
    as_items = api(client).responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}])
    assert as_items.output_text == reply.output_text

    events = list(api(client).responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.",
                                               max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == reply.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_result_sent_back(client, stream):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = api(client).responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, max_output_tokens=80,
                                         stream=stream)
    if stream:
        events = list(reply)
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        reply = events[-1].response
        assert events[-1].type == "response.completed" and [d.arguments for d in done] == \
            [item.arguments for item in reply.output]
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    items = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    follow = api(client).responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=4,
                                          temperature=0)
    turns = [*ask, {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                          "function": {"name": call.name,
                                                                                       "arguments": call.arguments}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    want = chat(client, turns, tools=tools, max_tokens=4, temperature=0)
    assert follow.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert follow.output_text == want["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
])
def test_what_needs_storage_or_is_not_here_is_refused_by_name(client, body, param):
    reply = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "store": False,
                                              "max_output_tokens": 1}).status_code == 200


def test_a_reasoning_models_thinking_is_a_reasoning_item():
    with LLM(MODEL, device="cpu", max_model_len=256, num_gpu_blocks_override=32, logits_processors=[Scripted]) as llm:
        tokenizer = llm.tokenizer
        Scripted.ids = [tokenizer.encode("<think>Two ones make two.</think>\n\nIt is 2.")]
        Scripted.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        with TestClient(build_app(llm, MODEL, reasoning_parser="qwen3")) as client:
            reply = api(client).responses.create(model=MODEL, input="What is 1+1?", max_output_tokens=40)
            assert [item.type for item in reply.output] == ["reasoning", "message"]
            assert reply.output[0].content[0].text == "Two ones make two." and reply.output_text == "\n\nIt is 2."
            assert reply.status == "completed" and reply.usage.output_tokens_details.reasoning_tokens > 0
            events = list(api(client).responses.create(model=MODEL, input="What is 1+1?", max_output_tokens=40,
                                                       stream=True))
            thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert (thought, text) == ("Two ones make two.", "\n\nIt is 2.")
            assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_a_json_schema_text_format_shapes_the_output(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    reply = api(client).responses.create(model=MODEL, input="A colour, as JSON.", max_output_tokens=30, temperature=1.0,
                                         text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    jsonschema.validate(json.loads(reply.output_text), schema)

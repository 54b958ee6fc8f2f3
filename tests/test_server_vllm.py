"""What vLLM's clients and routers expect of a server, through HTTP: vLLM's metric names, its rule for fields
nobody declares, token ids in responses, and its server flags (each a keyword of build_app, which
`nanoserve serve` passes on)."""
import json
import logging
import math
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve_faults import events, running

from nanoserve import LLM, SamplingParams
from nanoserve.serve.api_server import build_app

MODEL = "tiny-qwen3"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, device="cpu", max_model_len=512, num_gpu_blocks_override=128) as llm:
        yield llm


def scrape(url: str) -> dict:
    """/metrics as {(sample name, labels): value}, without the _created timestamps."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.name.endswith("_created")}


def vllm(samples: dict, name: str, **labels) -> float:
    return samples[(f"vllm:{name}", frozenset({"model_name": MODEL, "engine": "0", **labels}.items()))]


def post(url: str, endpoint: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{endpoint}", json={"model": MODEL, **body}, timeout=60, **kwargs)


def streamed(url: str, endpoint: str, body: dict) -> list:
    with httpx.stream("POST", f"{url}{endpoint}", json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        return [e for e in events(r.iter_lines()) if e != "[DONE]"]


def test_vllm_metric_names_move_with_the_requests(llm):
    """Every series also under vLLM's name and labels (model_name, engine), counting what the requests did:
    tokens, finishes, latencies, prefix-cache lookups; the gauges while a request runs and after."""
    prompt = list(range(2000, 2040))  # 40 tokens: the second time, its 2 full blocks of 16 come from the cache
    with running(build_app(llm, MODEL, enable_prompt_tokens_details=True)) as url:
        replies = [post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}).json()
                   for _ in range(2)]
        replies.append(post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True}).json())
        usages = [r["usage"] for r in replies]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages[:2]] == [0, 32]
        done = scrape(url)
        prompt_tokens, generated = (sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens"))
        assert vllm(done, "prompt_tokens_total") == prompt_tokens
        assert vllm(done, "generation_tokens_total") == generated == 11
        assert vllm(done, "request_success_total", finished_reason="length") == 3
        assert vllm(done, "time_to_first_token_seconds_count") == vllm(done, "e2e_request_latency_seconds_count") == 3
        assert vllm(done, "inter_token_latency_seconds_count") == generated - 3  # between tokens of one request
        assert vllm(done, "prefix_cache_queries_total") == prompt_tokens
        assert vllm(done, "prefix_cache_hits_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        # one observation per engine step (one request at a time: a prefill, then a step per other token), of
        # the prompt tokens it computed (not the cached ones) and the token it drew
        assert vllm(done, "iteration_tokens_total_count") == generated
        assert vllm(done, "iteration_tokens_total_sum") == prompt_tokens - 32 + generated
        # each vllm: series is a nanoserve: one under vLLM's name, with vLLM's labels
        ours = {(name.replace("nanoserve:", "vllm:"), labels | {("engine", "0")}): value
                for (name, labels), value in done.items() if name.startswith("nanoserve:")}
        assert ours == {key: value for key, value in done.items() if key[0].startswith("vllm:")} and len(ours) > 50

        with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "Go", "max_tokens": 300,
                                                                 "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # (held: an iterator let go of closes the connection, and the request ends)
            next(lines)
            busy = scrape(url)
        assert vllm(busy, "num_requests_running") == 1 and vllm(busy, "kv_cache_usage_perc") > 0
        for _ in range(200):  # the abandoned request is aborted before the next step, its blocks freed
            idle = scrape(url)
            if vllm(idle, "num_requests_running") == vllm(idle, "kv_cache_usage_perc") == 0:
                break
            time.sleep(0.02)
        assert vllm(idle, "num_requests_running") == vllm(idle, "num_requests_waiting") == 0
        assert vllm(idle, "kv_cache_usage_perc") == 0


def test_an_unknown_field_is_ignored_with_one_warning_naming_it(llm, caplog):
    """vLLM's rule: a field nothing declares is accepted and ignored, and the server logs one warning per
    request naming each such field (in stream_options too; a message's own are taken silently). A field we
    know and do not implement, or one of the other endpoint, stays a 400 naming it."""
    plain = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
    with running(build_app(llm, MODEL)) as url, caplog.at_level(logging.WARNING, logger="nanoserve.serve"):
        want = post(url, "/v1/completions", plain).json()["choices"][0]["text"]
        caplog.clear()
        extra = post(url, "/v1/completions", {**plain, "frobnicate": 1, "sdk_default": {"a": [1]}})
        assert extra.status_code == 200 and extra.json()["choices"][0]["text"] == want
        chat = streamed(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi", "refusal": None, "annotations": []}], "max_tokens": 2,
            "stream_options": {"include_usage": True, "later_option": True}})
        assert chat[-1]["usage"]["completion_tokens"] == 2
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 2, warned
        assert "'frobnicate'" in warned[0] and "'sdk_default'" in warned[0]
        assert "'stream_options.later_option'" in warned[1] and "refusal" not in warned[1]
        for endpoint, body, param in [("/v1/completions", {**plain, "best_of": 3}, "best_of"),
                                      ("/v1/completions", {**plain, "chat_template": "{{ 1 }}"}, "chat_template"),
                                      ("/v1/completions", {**plain, "max_completion_tokens": 1}, "max_completion_tokens"),
                                      ("/v1/chat/completions", {"messages": CHAT, "suffix": "!"}, "suffix"),
                                      ("/v1/completions", {**plain, "seed": 2**63}, "seed"),
                                      ("/v1/completions", {**plain, "seed": -2**63 - 1}, "seed")]:
            reply = post(url, endpoint, body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        too_big = post(url, "/v1/completions", {**plain, "seed": 2**63}).json()["error"]["message"]
        assert too_big.endswith("[type=less_than_equal]"), too_big  # pydantic's name for it, as vLLM's says
        for seed in (2**63 - 1, -2**63):  # int64's ends are seeds like any other
            assert post(url, "/v1/completions", {**plain, "seed": seed, "temperature": 1}).status_code == 200


def test_return_token_ids_whole_and_streamed(llm):
    """return_token_ids: the prompt's ids and each completion's (the end-of-text token included), the same
    whole or streamed; streamed, the prompt's ids come once (a chat's first chunk, a completion's first chunk
    of each choice). false (or left out): null."""
    tokenizer = llm.tokenizer
    body = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0.7, "seed": 5, "n": 2, "return_token_ids": True}
    want = llm.generate(["The sky is"], SamplingParams(max_tokens=5, temperature=0.7, seed=5, n=2), use_tqdm=False)[0]
    with running(build_app(llm, MODEL)) as url:
        whole = post(url, "/v1/completions", body).json()["choices"]
        assert [c["token_ids"] for c in whole] == [c.token_ids for c in want.outputs]
        assert all(c["prompt_token_ids"] == tokenizer.encode("The sky is") for c in whole)
        ids, prompts = {0: [], 1: []}, {0: [], 1: []}
        for event in streamed(url, "/v1/completions", body):
            for c in event["choices"]:
                ids[c["index"]] += c["token_ids"]
                prompts[c["index"]].append(c.get("prompt_token_ids"))
        assert [ids[0], ids[1]] == [c["token_ids"] for c in whole]
        assert all(p[0] == whole[0]["prompt_token_ids"] and not any(p[1:]) for p in prompts.values())
        off = post(url, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
        assert "token_ids" in off and off["token_ids"] is None and off["prompt_token_ids"] is None

        chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        reply = post(url, "/v1/chat/completions", chat).json()
        assert reply["prompt_token_ids"] == post(url, "/tokenize", {"messages": CHAT}).json()["tokens"]
        choice = reply["choices"][0]
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
        chunks = streamed(url, "/v1/chat/completions", chat)
        assert chunks[0]["prompt_token_ids"] == reply["prompt_token_ids"]
        assert not any("prompt_token_ids" in c for c in chunks[1:])
        assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])] == \
            reply["choices"][0]["token_ids"]
        off = post(url, "/v1/chat/completions", {**chat, "return_token_ids": False}).json()
        assert off["prompt_token_ids"] is None and off["choices"][0]["token_ids"] is None


def test_return_tokens_as_token_ids_the_field_and_the_flag(llm):
    """Log-probs name their tokens "token_id:N" when the request asks (return_tokens_as_token_ids) or the
    server does (--return-tokens-as-token-ids) and the request does not say otherwise."""
    decode = llm.tokenizer.decode
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_token_ids": True}
    chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}

    def completion_names(url, **extra):
        choice = post(url, "/v1/completions", {**body, **extra}).json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]

    with running(build_app(llm, MODEL)) as url:
        ids, logprobs = completion_names(url)
        assert logprobs["tokens"] == [decode([t]) for t in ids]
        ids, logprobs = completion_names(url, return_tokens_as_token_ids=True)
        assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
        # each step's own token first, then the likeliest (vLLM's order)
        assert all(next(iter(top)) == f"token_id:{t}" and len(top) >= 2
                   for t, top in zip(ids, logprobs["top_logprobs"]))
        named = post(url, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": True}).json()
        assert all(re.fullmatch(r"token_id:\d+", e["token"]) and all(re.fullmatch(r"token_id:\d+", t["token"])
                   for t in e["top_logprobs"]) for e in named["choices"][0]["logprobs"]["content"])
    with running(build_app(llm, MODEL, return_tokens_as_token_ids=True)) as url:
        ids, logprobs = completion_names(url)
        assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
        ids, logprobs = completion_names(url, return_tokens_as_token_ids=False)
        assert logprobs["tokens"] == [decode([t]) for t in ids]
        chunks = streamed(url, "/v1/completions", body)
        assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == \
            [f"token_id:{t}" for c in chunks for t in c["choices"][0]["token_ids"]]


def test_force_include_usage(llm):
    """--enable-force-include-usage: every chunk carries the counts so far and the stream ends with the usage
    chunk, whatever stream_options say (vLLM's rule)."""
    body = {"prompt": "Once", "max_tokens": 3, "ignore_eos": True}
    with running(build_app(llm, MODEL)) as url:
        assert all("usage" not in e for e in streamed(url, "/v1/completions", body))
    with running(build_app(llm, MODEL, enable_force_include_usage=True)) as url:
        for options in ({}, {"stream_options": {"include_usage": False}}):
            chunks = streamed(url, "/v1/completions", {**body, **options})
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
            assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]


def test_request_id_headers(llm):
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own or a new one (a
    401 too). The header names the completion ("cmpl-<id>"), flag or not, as vLLM's does."""
    body = {"prompt": "Hi", "max_tokens": 1}
    auth = {"Authorization": "Bearer k"}
    with running(build_app(llm, MODEL, api_key="k", enable_request_id_headers=True)) as url:
        given = post(url, "/v1/completions", body, headers={**auth, "X-Request-Id": "trace-7"})
        assert given.headers["x-request-id"] == "trace-7" and given.json()["id"] == "cmpl-trace-7"
        new = post(url, "/v1/completions", body, headers=auth)
        assert re.fullmatch("[0-9a-f]{32}", new.headers["x-request-id"])
        refused = post(url, "/v1/completions", body, headers={"X-Request-Id": "no-key"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
        assert "x-request-id" in httpx.get(f"{url}/health").headers
    with running(build_app(llm, MODEL)) as url:
        reply = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}, headers={"X-Request-Id": "t"})
        assert "x-request-id" not in reply.headers and reply.json()["id"] == "chatcmpl-t"


def test_models_root_and_tokenize_with_tools(llm):
    tools = [{"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    with running(build_app(llm, "mine")) as url:
        card, = httpx.get(f"{url}/v1/models").json()["data"]
        assert (card["id"], card["root"]) == ("mine", MODEL)
        body = {"model": "mine", "messages": CHAT}
        counted = httpx.post(f"{url}/tokenize", json={**body, "tools": tools}).json()["count"]
        plain = httpx.post(f"{url}/tokenize", json=body).json()["count"]
        used = httpx.post(f"{url}/v1/chat/completions", json={**body, "tools": tools, "max_tokens": 1}).json()
        assert counted == used["usage"]["prompt_tokens"] > plain


def test_vllm_api_key_from_the_environment(monkeypatch):
    """`nanoserve serve` with VLLM_API_KEY set and no --api-key: the key is the environment's, as vLLM's."""
    from fastapi.testclient import TestClient

    from nanoserve.cli import main
    from nanoserve.serve import api_server

    served = {}
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setattr(api_server, "serve", lambda llm, name, host, port, waiting, api_key, **kw:
                        served.update(llm=llm, name=name, api_key=api_key, **kw))
    flags = ["--enable-prompt-tokens-details", "--enable-server-load-tracking", "--enable-per-request-metrics"]
    assert main(["serve", MODEL, "--device", "cpu", "--num-gpu-blocks-override", "16", *flags,
                 "--root-path", "/llm"]) == 0
    assert all(served[f[2:].replace("-", "_")] is True for f in flags) and served["root_path"] == "/llm"
    with TestClient(build_app(served["llm"], served["name"], api_key=served["api_key"])) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    served["llm"].shutdown()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


def test_tool_call_text_takes_the_calls_out_of_a_stream():
    """Token by token (ids 1 and 2 stand for <tool_call> and </tool_call>): text outside a block is content
    at once; a block goes out whole when it closes, as one call; whitespace between calls is dropped; a block
    that is not a JSON call, or is cut off by the end, goes out as content."""
    from nanoserve.serve.protocol import ToolCallText

    def run(pieces, parallel=True):
        text = ToolCallText((1, 2), parallel)
        return [text.feed(t, s, last=i == len(pieces) - 1) for i, (t, s) in enumerate(pieces)]

    call = [(1, "<tool_call>"), (9, '\n{"name": "f", '), (9, '"arguments": {"x": 1}}\n'), (2, "</tool_call>")]
    out = run([(9, "Let me see."), *call, (9, "\n"), *call, (0, "")])
    assert out[0] == {"content": "Let me see."} and out[1:4] == [None] * 3 and out[5] is None
    first, second = out[4]["tool_calls"][0], out[9]["tool_calls"][0]
    assert (first["index"], second["index"], first["function"]) == (0, 1, {"name": "f", "arguments": '{"x": 1}'})
    assert first["type"] == "function" and first["id"] != second["id"] and out[-1] == {"content": ""}
    assert run([*call, *call, (0, "")], parallel=False)[7] is None  # the second call: not sent
    assert run([(1, "<tool_call>"), (9, "no json"), (2, "</tool_call>")])[-1] == {
        "content": "<tool_call>no json</tool_call>"}
    assert run(call[:3]) == [None, None, {"content": "".join(s for _, s in call[:3])}]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_calls_are_the_whole_replys(llm, tool_choice):
    """vLLM streams tool calls as delta.tool_calls: the openai client's pieces of a streamed reply add up
    to the calls (names, arguments), content, finish reason and token ids of the same reply whole."""
    import openai

    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER], tool_choice=tool_choice, temperature=1.0, seed=3, max_tokens=60,
                extra_body={"return_token_ids": True})
    with running(build_app(llm, MODEL)) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = api.chat.completions.create(**args).choices[0]
        calls, content, ids, finish = {}, "", [], None
        for chunk in api.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                ids += getattr(choice, "token_ids", None) or []
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or []:
                    assert call.index not in calls and call.id and call.function.name  # each call whole, once
                    calls[call.index] = (call.function.name, json.loads(call.function.arguments))
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == want and (want or tool_choice == "auto")
    # (whole, the text around calls is stripped, and None if empty)
    assert (content.strip() or None if want else content) == whole.message.content and finish == whole.finish_reason
    assert ids == whole.token_ids


def test_echo_alone_scores_the_prompt(llm):
    """echo with max_tokens 0 (lm-evaluation-harness's scoring): the prompt and its tokens' log-probs, the same
    as with max_tokens 1 less the new token; no completion tokens."""
    body = {"prompt": "The sky is blue", "echo": True, "logprobs": 1, "temperature": 0}
    with running(build_app(llm, MODEL)) as url:
        alone = post(url, "/v1/completions", {**body, "max_tokens": 0}).json()
        one = post(url, "/v1/completions", {**body, "max_tokens": 1}).json()
    prompt_tokens = alone["usage"]["prompt_tokens"]
    assert alone["usage"]["completion_tokens"] == 0 and alone["choices"][0]["text"] == "The sky is blue"
    scored, with_one = alone["choices"][0]["logprobs"], one["choices"][0]["logprobs"]
    assert scored["token_logprobs"] == with_one["token_logprobs"][:prompt_tokens]
    assert len(scored["tokens"]) == prompt_tokens and scored["token_logprobs"][0] is None


def test_structured_output_fields_that_agree_are_taken_together(llm):
    """Clients send vLLM's structured_outputs and its older guided_* name at once: taken when they ask for
    the same constraint (a schema as text or as JSON), refused naming the second when they differ."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    base = {"prompt": "x", "max_tokens": 12, "temperature": 0}
    with running(build_app(llm, MODEL)) as url:
        agree = post(url, "/v1/completions", {**base, "structured_outputs": {"choice": ["yes", "no"]},
                                              "guided_choice": ["yes", "no"]})
        assert agree.status_code == 200 and agree.json()["choices"][0]["text"] in ("yes", "no")
        schema_twice = post(url, "/v1/completions", {**base, "guided_json": json.dumps(schema),
                                                     "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "s", "schema": schema}}})
        assert schema_twice.status_code == 200, schema_twice.text
        differ = post(url, "/v1/completions", {**base, "structured_outputs": {"regex": "a+"}, "guided_regex": "b+"})
        assert differ.status_code == 400 and differ.json()["error"]["param"] == "guided_regex", differ.text


def test_server_load_orca_report_timings_and_root_path(llm):
    """--enable-server-load-tracking: GET /load counts the generation requests in flight (a stream until its
    end). An ORCA load report when a request asks for one (endpoint-load-metrics-format). With
    --enable-per-request-metrics a response carries its timings (a stream: on its usage chunk), and with
    --enable-prompt-tokens-details its usage the cached tokens (left out otherwise, as vLLM). --root-path:
    every route answers under the prefix too. /invocations is a chat or a completion, as its body says."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    app = build_app(llm, MODEL, enable_server_load_tracking=True, enable_per_request_metrics=True,
                    enable_prompt_tokens_details=True, root_path="/llm")
    with running(app) as url:
        assert httpx.get(f"{url}/llm/load").json() == {"server_load": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()  # (held: an iterator let go of closes the connection)
            next(lines)
            assert httpx.get(f"{url}/load").json() == {"server_load": 1}
        for _ in range(100):  # the stream's end is the request's
            if httpx.get(f"{url}/load").json()["server_load"] == 0:
                break
            time.sleep(0.02)
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}

        text = post(url, "/llm/v1/completions", body, headers={"endpoint-load-metrics-format": "TEXT"})
        report = text.headers["endpoint-load-metrics"]
        number = r"[\d.e-]+"
        assert re.fullmatch(rf"TEXT named_metrics\.kv_cache_usage_perc={number}, "
                            rf"named_metrics\.num_requests_waiting=0\.0", report), report
        reply = post(url, "/v1/completions", body, headers={"endpoint-load-metrics-format": "JSON"})
        named = json.loads(reply.headers["endpoint-load-metrics"].removeprefix("JSON "))["named_metrics"]
        assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
        assert reply.json()["choices"] == text.json()["choices"] and "endpoint-load-metrics" not in \
            post(url, "/v1/completions", body).headers
        metrics = reply.json()["metrics"]
        assert set(metrics) == {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms",
                                "tokens_per_second"} and min(metrics.values()) >= 0
        assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        chunks = streamed(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                         "stream_options": {"include_usage": True}})
        assert "mean_itl_ms" not in chunks[-1]["metrics"] and "time_to_first_token_ms" in chunks[-1]["metrics"]
        assert not any("metrics" in c for c in chunks[:-1])

        chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0}
        for route, request in (("/v1/chat/completions", chat), ("/v1/completions", body)):
            invoked = post(url, "/invocations", request).json()
            assert invoked["object"] == post(url, route, request).json()["object"]
            assert invoked["choices"] == post(url, route, request).json()["choices"]
        assert post(url, "/invocations", {"messages": "not a list"}).status_code == 400
    with running(build_app(llm, MODEL)) as url:
        plain = post(url, "/v1/completions", body).json()
        assert "prompt_tokens_details" not in plain["usage"] and "metrics" not in plain
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}  # not counted without the flag


def test_chat_echo_forwarded_prompt_ids_and_truncation_side(llm):
    """A chat's echo puts the continued message in front of the answer (whole and streamed); a prefill
    server's prompt_token_ids in kv_transfer_params are the prompt, unrendered; truncation_side "right" keeps
    a prompt's first truncate_prompt_tokens tokens, "left" (the default) its last. A log-prob count of -1
    is the whole vocabulary, within the server's max_logprobs."""
    saying = "An apple a day keeps"
    chat = {"messages": [{"role": "user", "content": "Say a saying"}, {"role": "assistant", "content": saying}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True, "max_tokens": 3,
            "temperature": 0, "return_token_ids": True}
    with running(build_app(llm, MODEL)) as url:
        reply = post(url, "/v1/chat/completions", chat).json()
        answer = llm.tokenizer.decode(reply["choices"][0]["token_ids"], skip_special_tokens=True)
        assert reply["choices"][0]["message"]["content"] == saying + answer
        pieces = streamed(url, "/v1/chat/completions", chat)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in pieces if c["choices"]) == saying + answer
        other = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
                 "kv_transfer_params": {"prompt_token_ids": reply["prompt_token_ids"]}}
        forwarded = post(url, "/v1/chat/completions", other).json()
        assert forwarded["prompt_token_ids"] == reply["prompt_token_ids"]
        assert forwarded["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]

        ids = list(range(100, 108))
        for side, kept in (("right", ids[:4]), ("left", ids[-4:]), (None, ids[-4:])):
            cut = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                                "truncation_side": side, "return_token_ids": True}).json()
            assert cut["choices"][0]["prompt_token_ids"] == kept
        wrong = post(url, "/v1/completions", {"prompt": ids, "truncation_side": "middle"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "truncation_side"
        whole = post(url, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1})
        assert whole.status_code == 400 and "the whole vocabulary, 151936" in whole.json()["error"]["message"]


def test_logprob_token_ids_whole_and_streamed(llm):
    """logprob_token_ids: each new token's log-probs of exactly the given ids and the drawn token, in place of
    the top-k, whole and streamed alike; refused without logprobs, where no token is generated, and for ids
    the model does not have."""
    given = [5000, 42, 100]
    chat = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "logprob_token_ids": given, "return_tokens_as_token_ids": True}

    def token(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    with running(build_app(llm, MODEL)) as url:
        whole = post(url, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
        parts = [e for c in streamed(url, "/v1/chat/completions", chat) if c["choices"] and c["choices"][0]["logprobs"]
                 for e in c["choices"][0]["logprobs"]["content"]]
        assert parts == whole and len(whole) == 3
        for e in whole:
            named = {token(t["token"]): t["logprob"] for t in e["top_logprobs"]}
            assert set(named) == {*given, token(e["token"])} and len(named) == len(e["top_logprobs"])
            assert named[token(e["token"])] == e["logprob"] and all(-math.inf < v <= 0 for v in named.values())
        scored = post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1,
                                               "logprob_token_ids": given}).json()["choices"][0]["logprobs"]
        assert all(len(top) in (3, 4) for top in scored["top_logprobs"])
        for endpoint, body in [("/v1/chat/completions", {"messages": CHAT, "logprob_token_ids": given}),
                               ("/v1/completions", {"prompt": [5, 6], "logprob_token_ids": given}),
                               ("/v1/completions", {"prompt": [5, 6], "echo": True, "max_tokens": 0, "logprobs": 1,
                                                    "logprob_token_ids": given}),
                               ("/v1/completions", {"prompt": [5, 6], "logprobs": 1, "logprob_token_ids": [10 ** 6]}),
                               ("/v1/completions", {"prompt": [5, 6], "logprobs": 1, "logprob_token_ids": [1] * 129})]:
            refused = post(url, endpoint, body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprob_token_ids", refused.text

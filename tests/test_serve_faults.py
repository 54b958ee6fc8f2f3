"""The server's faults, against a uvicorn server in this process (so a test can reach into its engine and
tokenizer): limits, error shapes, a huge prompt tokenised off the event loop, and failures that stay with
the requests they belong to. (test_serve.py drives the real `nanoserve serve` process.)"""
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from nanoserve.serve.api_server import MAX_BODY_BYTES, build_app
from nanoserve.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, check_limits, parse_body

MODEL = "tiny-qwen3"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def llm():
    from nanoserve import LLM

    # On the CPU on any machine: the faults are injected into lesson 05's step (a GPU's replays skip run())
    with LLM(MODEL, max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=64, device="cpu") as llm:
        yield llm


@contextlib.contextmanager
def running(app):
    """uvicorn serving `app` in a thread; yields its URL. log_config=None: its log records reach caplog."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def greedy(llm, prompt_ids: list[int], max_tokens: int) -> str:
    """What a clean run gives: the oracle for a request that must not notice another one's failure."""
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].text


def events(lines) -> list:
    """The data of each server-sent event, parsed ("[DONE]" stays a string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def wait_until_idle(llm, seconds: float = 10) -> None:
    pool, deadline = llm.engine.cache.block_manager, time.monotonic() + seconds
    while llm.engine.has_unfinished() or pool.num_free != pool.num_blocks:
        assert time.monotonic() < deadline, "requests still hold the engine"
        time.sleep(0.02)


# 1. Limits, checked before anything is tokenised or queued.

def test_limits_name_their_parameter():
    check_limits(CompletionRequest(prompt="x", n=128, logprobs=20), max_logprobs=20)
    check_limits(ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=20), max_logprobs=20)
    cases = [(CompletionRequest(prompt="x", n=129), 20, "n"),
             (CompletionRequest(prompt="x", logprobs=6), 5, "logprobs"),
             (CompletionRequest(prompt="x", logprobs=-1), 5, "logprobs"),
             (ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=21), 20, "top_logprobs")]
    for request, max_logprobs, param in cases:
        with pytest.raises(BadRequest) as bad:
            check_limits(request, max_logprobs)
        assert bad.value.param == param


def test_a_body_over_the_limit_gets_400_before_it_is_parsed(llm):
    assert MAX_BODY_BYTES == 8 * 2**20
    too_big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()
    with running(build_app(llm, MODEL, max_body_bytes=4096)) as url:
        for content in (too_big, iter([too_big[:3000], too_big[3000:]])):  # with a Content-Length, and chunked
            reply = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
            assert reply.status_code == 400 and set(reply.json()["error"]) == ERROR_KEYS
            assert "4096 bytes" in reply.json()["error"]["message"]
        small = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2})
        assert small.status_code == 200


# 2. Tokenising runs off the event loop.

@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_huge_prompt_being_tokenised_does_not_stop_other_streams(llm, monkeypatch, endpoint):
    """One request's tokenising blocks until released: meanwhile a stream that was
    already running keeps getting tokens and /health answers. On the event loop, both would wait."""
    entered, release = threading.Event(), threading.Event()
    tokenizer = llm.tokenizer
    name = "encode"  # a chat request's rendered template is encoded too
    original = getattr(tokenizer, name)

    def slow(text_or_conversation, *args, **kwargs):
        if "HUGE" in str(text_or_conversation):
            entered.set()
            release.wait(30)
        return original(text_or_conversation, *args, **kwargs)

    monkeypatch.setattr(tokenizer, name, slow, raising=False)
    huge = {"prompt": "HUGE"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "HUGE"}]}
    with running(build_app(llm, MODEL)) as url:
        result = {}
        slow_request = threading.Thread(target=lambda: result.update(reply=httpx.post(
            f"{url}/v1/{endpoint}", json={**huge, "max_tokens": 2}, timeout=60)))
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=10,
                              json={"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
                lines = s.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # the stream runs
                slow_request.start()
                assert entered.wait(10), "the huge request never reached the tokenizer"
                got = [line for _, line in zip(range(20), (x for x in lines if x.startswith("data: ")))]
                assert len(got) == 20  # ... and goes on while the other one is being tokenised
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        finally:
            release.set()
            if slow_request.ident is not None:  # started
                slow_request.join(timeout=60)
        assert result["reply"].status_code == 200
    wait_until_idle(llm)


# 3. Error shapes: OpenAI's error JSON for every mistake, and no traceback in the log.

def test_parse_body_names_what_is_wrong():
    assert parse_body(b'{"prompt": "caf\xc3\xa9", "n": 2}') == {"prompt": "café", "n": 2}
    cases = [(b'{"prompt": "a\\ud800"}', "prompt", "not valid Unicode"),
             (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "messages",
              "not valid Unicode"),
             (b'{"\\ud800": 1}', None, "not valid Unicode"),
             (b'{"prompt": "a\xff"}', None, "UTF-8"),
             (b'{"prompt": ', None, "not valid JSON"),
             (b'[1, 2]', None, "JSON object"),
             # the parser's own limit (Python 3.11; a later one's parser may go deeper, and then ours names it)
             (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", (None, "prompt"), "deeper"),
             (b'{"x": ' + b"[" * 100 + b"]" * 100 + b"}", "x", "deeper")]  # ours
    for body, param, words in cases:
        with pytest.raises(BadRequest, match=words) as bad:
            parse_body(body)
        assert bad.value.param in (param if isinstance(param, tuple) else (param,))


def test_bad_bodies_get_openai_errors_and_no_traceback(llm, caplog):
    json_type = {"content-type": "application/json"}
    bad = [("post", "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', 400, "prompt"),
           ("post", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
           ("post", "/v1/completions", b'{"prompt": "a\xff\xfe", "max_tokens": 2}', 400, None),
           ("post", "/v1/completions", b"{not json", 400, None),
           ("post", "/v1/completions", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, (None, "prompt")),
           ("post", "/v1/completions", b'{"prompt": "x", "n": 129}', 400, "n"),
           ("post", "/v1/completions", b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
           ("get", "/v1/nowhere", None, 404, None),
           ("put", "/v1/completions", b"{}", 405, None)]
    caplog.set_level(logging.WARNING)
    with running(build_app(llm, MODEL)) as url:
        for method, path, body, status, param in bad:
            reply = httpx.request(method, f"{url}{path}", content=body, headers=json_type)
            assert reply.status_code == status, (path, body, reply.text)
            assert set(reply.json()) == {"error"} and set(reply.json()["error"]) == ERROR_KEYS, reply.text
            assert reply.json()["error"]["param"] in (param if isinstance(param, tuple) else (param,))
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if r.exc_info], "a client's mistake left a traceback in the log"
    assert len(caplog.records) <= len(bad)


# 4. A failure stays with the requests it belongs to.

A_PROMPT, B_PROMPT, C_PROMPT = [11, 12, 13], [5, 6, 7], [8, 9]


@pytest.mark.parametrize("named", [True, False], ids=["engine names the step's sequences", "running fall back"])
def test_a_failed_step_fails_only_the_requests_in_it(llm, monkeypatch, named):
    """A and C run (two at most), B waits; one step raises. The engine names the step's sequences:
    `named` makes it name only A's, or none (then the running ones, A and C, fail). B never fails: it
    completes with a clean run's text, and so does C when it was not named."""
    b_text, c_text = greedy(llm, B_PROMPT, 8), greedy(llm, C_PROMPT, 20)
    engine, app = llm.engine, build_app(llm, MODEL)
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 2)  # B must wait for a place in the batch
    run, fired = engine.runner.launch, []

    def runner_run(batch, previous=None):
        prompts = [s.prompt_ids for s in batch.seqs]
        if not fired and A_PROMPT in prompts and C_PROMPT in prompts:
            if not engine.scheduler.waiting:  # hold A and C here until B is queued: then it has to wait
                deadline = time.monotonic() + 20
                while not app.state.engine.to_add and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                fired.append(len(engine.scheduler.waiting))
                engine.step_seqs = [s for s in batch.seqs if s.prompt_ids == A_PROMPT] if named else []
                raise RuntimeError("injected step failure")
        return run(batch, previous)

    monkeypatch.setattr(engine.runner, "launch", runner_run)

    async def stream(http, url, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            return events([line async for line in reply.aiter_lines()])

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as http:
            a = asyncio.create_task(stream(http, url, A_PROMPT, 400))
            while len(engine.scheduler.running) < 1:  # (reading the scheduler from here is racy, but only waits)
                await asyncio.sleep(0.01)
            c = asyncio.create_task(stream(http, url, C_PROMPT, 20))
            while len(engine.scheduler.running) < 2:
                await asyncio.sleep(0.01)
            b = await http.post(f"{url}/v1/completions",
                                json={"prompt": B_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            return await a, b, await c, await http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})

    with running(app) as url:
        a, b, c, after = asyncio.run(main(url))
        assert httpx.get(f"{url}/health").status_code == 200
    assert fired == [1]  # it failed with A and C in the step and B waiting
    assert a[-1] == "[DONE]" and "engine step failed" in a[-2]["error"]["message"]
    assert b.status_code == 200 and b.json()["choices"][0]["text"] == b_text
    if named:
        assert c[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in c[:-1]) == c_text
    else:
        assert "engine step failed" in c[-2]["error"]["message"]
    assert after.status_code == 200
    wait_until_idle(llm)


def test_a_sequence_the_engine_fails_alone_fails_only_its_request(llm, monkeypatch):
    """The engine hands back (seq, None) with finish_reason "error" for X's sequence and for one of Z's two
    (as LLMEngine.fail does: its blocks back, seq.error says why). X's stream ends with an error event, Z
    gets HTTP 500 and its other completion stops too; Y gets a clean run's text."""
    x_prompt, y_prompt, z_prompt = [21, 22], [5, 6, 7], [31, 32]
    y_text = greedy(llm, y_prompt, 30)
    engine = llm.engine
    step = engine.step

    def failing_step():
        out = []
        for seq, token in step():
            doomed = seq.prompt_ids in (x_prompt, z_prompt) and seq.index == 0 and seq.num_output_tokens == 3
            if token is not None and doomed:
                seq.finish_reason, seq.error = "error", "injected failure"
                engine.scheduler.abort(seq)
                token = None
            out.append((seq, token))
        return out

    monkeypatch.setattr(engine, "step", failing_step)
    common = {"max_tokens": 100, "ignore_eos": True}

    async def main(url):
        async with httpx.AsyncClient(timeout=30) as http:
            async def x():
                async with http.stream("POST", f"{url}/v1/completions",
                                       json={"prompt": x_prompt, "stream": True, **common}) as reply:
                    return events([line async for line in reply.aiter_lines()])

            z = http.post(f"{url}/v1/completions", json={"prompt": z_prompt, "n": 2, "seed": 3, **common})
            y = http.post(f"{url}/v1/completions", json={"prompt": y_prompt, "max_tokens": 30, "temperature": 0,
                                                         "ignore_eos": True})
            return await asyncio.gather(x(), z, y)

    with running(build_app(llm, MODEL)) as url:
        x, z, y = asyncio.run(main(url))
        wait_until_idle(llm)  # Z's other completion was aborted: nothing runs, every block is free
        metrics = httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert x[-1] == "[DONE]" and "injected failure" in x[-2]["error"]["message"]
    assert len([e for e in x if "choices" in e]) == 2  # the tokens before it failed
    assert z.status_code == 500 and z.json()["error"]["type"] == "server_error"
    assert "injected failure" in z.json()["error"]["message"]
    assert y.status_code == 200 and y.json()["choices"][0]["text"] == y_text
    errors = [line for line in metrics.splitlines()
              if line.startswith("nanoserve:request_success_total{") and 'finished_reason="error"' in line]
    assert [float(line.rsplit(" ", 1)[1]) for line in errors] == [2.0]  # X and Z, counted as finished with "error"

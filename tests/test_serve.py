"""`nanoserve serve`, tested as a user would: a real server process, the official openai client."""
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from nanoserve.serve.protocol import BadRequest, CompletionRequest, sampling_params, sse

MODEL = "tiny-qwen3"
MAX_NUM_SEQS, MAX_WAITING = 8, 24  # the server holds at most 32 requests
MAX_LOGPROBS = 5  # below the default (20): the flag must reach the server's checks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc, url: str, output) -> None:
    """Wait (up to 2 minutes) for a server process to answer /health; output(): what it printed, if it exits."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the server exited: {output()}"
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", MODEL, "--port", str(port),
                             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                             "--max-logprobs", str(MAX_LOGPROBS), "--device", "cpu"],  # CPU defaults, on any machine
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, proc.stdout.read)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def llm():
    """The same model in this process: the oracle for the server's answers."""
    from nanoserve import LLM

    with LLM(MODEL, device="cpu") as llm:
        yield llm


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"nanoserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until_idle(url: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while (metric(url, "num_requests_running"), metric(url, "kv_cache_usage_perc")) != (0, 0):
        assert time.monotonic() < deadline, "requests still hold the engine"
        time.sleep(0.05)


# Pure parts.

def test_sse_events():
    assert sse({"a": 1}) == 'data: {"a": 1}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


def test_a_bad_parameter_is_named():
    with pytest.raises(BadRequest) as bad:
        sampling_params(CompletionRequest(prompt="x", top_p=1.5), None, None, default_max_tokens=16)
    assert bad.value.param == "top_p"
    with pytest.raises(BadRequest) as bad:
        sampling_params(CompletionRequest(prompt="x", n=0), None, None, default_max_tokens=16)
    assert bad.value.param == "n"


def test_api_key_guards_the_v1_routes(llm):
    from fastapi.testclient import TestClient

    from nanoserve.serve.api_server import build_app

    with TestClient(build_app(llm, MODEL, api_key="secret")) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        assert http.get("/health").status_code == 200
        # the key comes first: a malformed body without it is a 401, not a 400 about the body
        json_type = {"content-type": "application/json"}
        for key in ({}, {"Authorization": "Bearer wrong"}):
            reply = http.post("/v1/completions", content=b"{not json", headers={**json_type, **key})
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        key = {"Authorization": "Bearer secret"}
        assert http.post("/v1/completions", content=b"{not json", headers={**json_type, **key}).status_code == 400


# Against the server.

def test_models_list(server):
    _, url = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_greedy_completion_equals_llm_generate(server, llm):
    from nanoserve import SamplingParams

    _, url = server
    prompt = "The quick brown fox"
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)


def test_streamed_chat_equals_the_whole_reply(server):
    _, url = server
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
                temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    whole = client(url).chat.completions.create(**args)
    chunks = list(client(url).chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_concurrent_streams_and_abandoned_ones(server):
    """32 streams at once; every fourth client leaves after 3 chunks of a request that would run for
    thousands of tokens. The others get all their tokens; then nothing runs and no KV block is held."""
    _, url = server

    async def one(i: int, api: openai.AsyncOpenAI):
        abandon = i % 4 == 0
        stream = await api.completions.create(model=MODEL, prompt=f"Request number {i}:", stream=True,
                                              max_tokens=3000 if abandon else 16 + i, temperature=1.0, seed=i,
                                              extra_body={"ignore_eos": True})
        tokens = 0
        async for c in stream:
            tokens += 1
            if abandon and tokens == 3:
                await stream.close()
                return None
        return tokens

    async def main():
        api = async_client(url)
        return await asyncio.gather(*(one(i, api) for i in range(32)))

    counts = asyncio.run(main())
    assert [c for i, c in enumerate(counts) if i % 4] == [16 + i for i in range(32) if i % 4]
    wait_until_idle(url, seconds=5)  # an abandoned request left to run would hold the engine for minutes


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_request(server):
    _, url = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Long", "max_tokens": 3000,
                                                  "ignore_eos": True}, timeout=1.0)
    wait_until_idle(url, seconds=5)


def test_bad_requests_get_400_and_the_server_goes_on(server):
    _, url = server
    api = client(url)
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt="Hi", top_p=2.0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=4)
    assert "max_model_len" in bad.value.body["message"]
    raw = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert api.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason in ("length", "stop")


def test_limits_get_400_naming_the_parameter(server):
    """n over 128 and log-probs over the server's --max-logprobs, refused before anything is queued."""
    _, url = server
    api = client(url)
    chat = [{"role": "user", "content": "Hi"}]
    refused = [(api.completions.create, dict(prompt="Hi", n=129), "n"),
               (api.completions.create, dict(prompt="Hi", logprobs=MAX_LOGPROBS + 1), "logprobs"),
               (api.chat.completions.create, dict(messages=chat, logprobs=True, top_logprobs=MAX_LOGPROBS + 1),
                "top_logprobs")]
    for create, args, param in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            create(model=MODEL, max_tokens=2, **args)
        assert bad.value.body["param"] == param
    reply = api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=MAX_LOGPROBS)
    assert len(reply.choices[0].logprobs.top_logprobs[0]) >= MAX_LOGPROBS


def test_a_full_queue_answers_503(server):
    _, url = server

    async def main():
        api = async_client(url)
        held = [await api.completions.create(model=MODEL, prompt="Hold", max_tokens=3000, stream=True,
                                             extra_body={"ignore_eos": True}) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
        try:
            with pytest.raises(openai.APIStatusError) as full:
                await api.completions.create(model=MODEL, prompt="One more", max_tokens=2)
        finally:
            for stream in held:
                await stream.close()
        return full.value

    full = asyncio.run(main())
    assert full.status_code == 503 and full.body["type"] == "service_unavailable_error"
    wait_until_idle(url)
    assert client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_bench_serve_counts_every_token(server, tmp_path):
    """The serving benchmark against the server: every request completes with exactly its max_tokens."""
    from nanoserve.serve.benchmark import DEFAULT_EXTRA_BODY, BenchRequest, run_at_rate

    _, url = server
    requests = [BenchRequest(f"Question {i}?", 6 + i) for i in range(6)]
    for rate in (50.0, float("inf")):
        s = asyncio.run(run_at_rate(url, MODEL, requests, rate, "completions", json.loads(DEFAULT_EXTRA_BODY), None))
        assert (s["completed"], s["failed"], s["output_tokens"]) == (6, 0, sum(6 + i for i in range(6)))
        assert 0 < s["ttft"]["median_ms"] <= s["ttft"]["p99_ms"] and s["itl"]["median_ms"] > 0


def test_bench_serve_takes_vllm_bench_serves_flags(server, tmp_path, capsys):
    from nanoserve.cli import main

    _, url = server
    port = url.rsplit(":", 1)[1]
    assert main(["bench-serve", "--port", port, "--model", MODEL, "--backend", "openai", "--endpoint", "/v1/completions",
                 "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "5", "--num-prompts", "6",
                 "--max-concurrency", "2", "--ignore-eos", "--percentile-metrics", "ttft,e2el", "--metric-percentiles",
                 "50,90", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]) == 0
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert (run["completed"], run["output_tokens"]) == (6, 30)  # 6 random prompts, 5 tokens each (ignore_eos)
    assert set(run["e2el"]) == {"median_ms", "p50_ms", "p90_ms"} and run["e2el"]["p90_ms"] >= run["ttft"]["p90_ms"]
    printed = capsys.readouterr().out
    assert "E2EL" in printed and "TPOT" not in printed  # the metrics asked for, and only those
    assert main(["bench-serve", "--port", port, "--model", MODEL, "--dataset-name", "custom"]) == 2  # needs a path


def test_sigterm_ends_streams_with_an_error_and_exits_0(server):
    """Runs last: it stops the module's server."""
    proc, url = server
    api = client(url)
    stream = api.completions.create(model=MODEL, prompt="Go on", max_tokens=3000, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):  # cut short: 3,000 tokens never came
        for _ in stream:
            pass
    # generous bounds (a loaded machine is slow): the error above is what shows the stream did not run to its end
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - start < 30

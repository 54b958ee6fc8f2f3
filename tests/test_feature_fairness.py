"""A request's feature cannot slow a bystander: a plain greedy completion sent while a big request (n=128) is
generating WITH a feature (a grammar, penalties, logit_bias or allowed_token_ids over the whole vocabulary,
10,000 bad words) takes about as long as it does beside the same big request WITHOUT it.

The batch is shared: every step runs all the rows together, so whatever a feature costs per step (a mask over
151,936 tokens for each of 128 rows, say) is paid by every request in the step, the bystander included. A
feature's own preparation (tokenising 10,000 bad words, compiling a grammar) happens before its request is
admitted, and is not what this measures: the bystander is sent once every one of the big request's 128
completions has its first token, so it shares the big request's decode steps, and its time is those steps'.

Target: the bystander's time beside the request with the feature <= 1.5x its time beside the same request
without it (TARGET); that time without a feature is measured once for the five features (`plain`), after an
untimed warm-up. The test allows 2.0x (LIMIT), and a second pair of measurements, side by side, when the first
ratio lands between LIMIT and 2 * LIMIT: on a loaded CI machine (2 pytest workers on 2 cores) one timing can be
off by tens of percent, while the known bad cases are far beyond: at 312df7f (before features moved beside the core),
on 2 cores, logit_bias and allowed_token_ids over the whole vocabulary made the bystander 5.6-8.2x slower
(each step built Python lists of 128 x 151,936 entries), and /health waited up to 3 s. /health must answer
within HEALTH_LIMIT seconds all along.

Run alone, with every number printed: pytest -q -s -p no:randomly tests/test_feature_fairness.py
"""
import json
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import httpx
import pytest

from nanoserve.model.zoo import resolve_model
from test_serve import free_port, wait_until_healthy

MODEL = "tiny-qwen3"
VOCAB_SIZE = 151_936  # Qwen3's embedding rows (config.json's vocab_size; its tokenizer names 151,669 of them)
N, HEAVY_TOKENS = 128, 16  # the big request: 128 completions at temperature 1, 16 tokens each (ignore_eos)
HEAVY_PROMPT = "Once upon a time, in a land far away, there lived"
BYSTANDER = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
TARGET = 1.5  # the requirement: a feature makes a bystander at most 1.5x slower
LIMIT = 2.0  # what the test asserts (the module docstring says why it is looser than TARGET)
HEALTH_LIMIT = 2.0  # seconds: /health answers within this while the big request runs
FEATURES = ["grammar", "penalties", "logit_bias", "allowed_token_ids", "bad_words"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for every feature: a real `nanoserve serve` process on the CPU, with its defaults
    (max_num_seqs 256: the big request's 128 completions and the bystander share every step). Its output goes
    to a file (a pipe nobody reads would stop it once full)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", MODEL, "--port", str(port),
                                 "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, lambda: log.read_text()[-3000:])
        warm = httpx.post(f"{url}/v1/completions", json=BYSTANDER, timeout=60)
        assert warm.status_code == 200, warm.text
        bystander_beside(url, {})  # the first big batch allocates what later ones reuse: not timed
        yield url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def plain(server) -> "Trial":
    """The bystander beside the big request without a feature: what each feature's time is compared with (one
    measurement for all five; a ratio that noise could explain measures a fresh pair)."""
    return bystander_beside(server, {})


@pytest.fixture(scope="module")
def words() -> list[str]:
    """The vocabulary's words: its tokens that are a space and 4 or more lowercase ASCII letters (22,129)."""
    from transformers import AutoTokenizer

    path = resolve_model(MODEL)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert 150_000 < len(tokenizer) <= VOCAB_SIZE  # the rows past the tokenizer's are real logits too
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return sorted({t[1:] for t in tokens if t.startswith("Ġ") and len(t) >= 5 and t[1:].isascii()
                   and t[1:].isalpha() and t[1:].islower()})


def feature_fields(feature: str, words: list[str]) -> dict:
    """The big request's extra fields for each feature, as a client sends them (vLLM's extra fields included)."""
    if feature == "grammar":  # 300 letters: no completion can finish it (and leave the batch) within 16 tokens
        return {"structured_outputs": {"regex": "[a-z ]{300}"}}
    if feature == "penalties":
        return {"repetition_penalty": 1.2, "presence_penalty": 1.0, "frequency_penalty": 1.0}
    if feature == "logit_bias":  # OpenAI's keys are strings
        return {"logit_bias": {str(t): 0.5 for t in range(VOCAB_SIZE)}}
    if feature == "allowed_token_ids":
        return {"allowed_token_ids": list(range(VOCAB_SIZE))}
    if feature == "bad_words":  # 10,000 distinct real words (" word" is one token: each row bans 10,000+ every step)
        assert len(words) >= 20_000
        return {"bad_words": words[::2][:10_000]}
    raise ValueError(feature)


@dataclass
class Trial:
    bystander_s: float  # the bystander's completion, request to response
    health_s: list[float] = field(default_factory=list)  # /health's latencies meanwhile

    def health(self) -> str:
        return f"/health median {statistics.median(self.health_s):.3f} s, max {max(self.health_s):.3f} s"


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"nanoserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until_idle(url: str, seconds: float = 120) -> None:
    """The last big request was aborted: its rows leave between two steps (a slow step is seconds)."""
    deadline = time.monotonic() + seconds
    while metric(url, "num_requests_running") or metric(url, "num_requests_waiting"):
        assert time.monotonic() < deadline, "the aborted request still holds the engine"
        time.sleep(0.05)


def bystander_beside(url: str, extra: dict) -> Trial:
    """The bystander's time while the big request (with `extra`) generates. The big request is streamed; the
    bystander goes once all N completions have their first token (the big request was admitted, its
    preparation done, and it is decoding), and the big request is aborted (its stream closed) once the
    bystander is back. /health is polled all the while."""
    heavy = {"model": MODEL, "prompt": HEAVY_PROMPT, "n": N, "max_tokens": HEAVY_TOKENS, "temperature": 1.0,
             "seed": 0, "ignore_eos": True, "stream": True, **extra}
    decoding, stop = threading.Event(), threading.Event()
    state = {"started": set(), "finished": 0, "done": False, "error": None}

    def read_heavy():
        try:
            with httpx.Client(timeout=300) as http, http.stream("POST", f"{url}/v1/completions", json=heavy) as r:
                if r.status_code != 200:
                    state["error"] = f"HTTP {r.status_code}: {r.read().decode()[:500]}"
                    return
                for line in r.iter_lines():
                    if stop.is_set():
                        return  # closing the stream aborts the request
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        state["error"] = f"stream error: {str(chunk['error'])[:500]}"
                        return
                    for choice in chunk["choices"]:
                        state["started"].add(choice["index"])
                        state["finished"] += choice.get("finish_reason") is not None
                    if len(state["started"]) == N:
                        decoding.set()
        except Exception as e:  # noqa: BLE001 (reported by the test's assertion)
            state["error"] = f"{type(e).__name__}: {e}"
        finally:
            state["done"] = True
            decoding.set()

    health, polling = [], threading.Event()

    def poll_health():
        with httpx.Client(timeout=30) as http:
            while not polling.is_set():
                start = time.monotonic()
                try:
                    ok = http.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                health.append(time.monotonic() - start if ok else float("inf"))  # no answer: inf
                polling.wait(0.2)

    reader = threading.Thread(target=read_heavy, daemon=True)
    poller = threading.Thread(target=poll_health, daemon=True)
    reader.start()
    try:
        assert decoding.wait(300), "the big request did not start decoding within 300 s"
        assert state["error"] is None, f"the big request failed ({sorted(extra)}): {state['error']}"
        assert not state["done"], "the big request ended before the bystander was sent"
        poller.start()
        start = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json=BYSTANDER, timeout=300)
        seconds = time.monotonic() - start
        polling.set()
        poller.join(60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        # Beside the whole time: no completion of the big request had finished (left the batch) meanwhile
        assert not state["done"] and state["finished"] == 0, \
            f"the big request ended before the bystander did: raise HEAVY_TOKENS ({state})"
        assert health, "/health was never answered"
    finally:
        polling.set()
        stop.set()
        reader.join(300)
    wait_until_idle(url)
    return Trial(seconds, health)


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_of_one_request_does_not_slow_a_bystander(server, plain, words, feature):
    extra = feature_fields(feature, words)
    pairs = []
    while True:
        if pairs:  # the second pair: both measured now, one after the other
            plain = bystander_beside(server, {})
        featured = bystander_beside(server, extra)
        pairs.append((plain, featured))
        ratio = featured.bystander_s / plain.bystander_s
        print(f"\n{feature}: bystander {plain.bystander_s:.2f} s beside the plain request ({plain.health()}), "
              f"{featured.bystander_s:.2f} s beside it with {feature} ({featured.health()}): x{ratio:.2f}")
        # A second pair only where noise could explain the first: not for one far beyond the limit
        if ratio <= LIMIT or ratio > 2 * LIMIT or len(pairs) == 2:
            break
    plain, featured = min(pairs, key=lambda p: p[1].bystander_s / p[0].bystander_s)
    ratio = featured.bystander_s / plain.bystander_s
    message = (f"{feature} on a request of n={N} slows a bystander's 4-token greedy completion {ratio:.2f}x: "
               f"{featured.bystander_s:.2f} s beside it against {plain.bystander_s:.2f} s beside the same request "
               f"without {feature} (target <= {TARGET}x, asserted <= {LIMIT}x; best of {len(pairs)} pair(s))")
    problems = [message] if ratio > LIMIT else []
    for i, trial in enumerate(t for pair in pairs for t in pair):
        if max(trial.health_s) >= HEALTH_LIMIT:
            problems.append(f"/health was slow beside the big request {'with' if i % 2 else 'without'} {feature}: "
                            f"{trial.health()} (limit {HEALTH_LIMIT} s)")
    assert not problems, "; ".join(problems)
    if ratio > TARGET:  # within what the test allows, not within the target: said in pytest's warnings summary
        warnings.warn(message, stacklevel=1)

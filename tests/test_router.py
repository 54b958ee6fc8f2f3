"""Data parallelism without a router of our own: two `nanoserve serve` replicas behind vllm-router (the dev
extra installs it). Through the router's port: requests spread, a shared prefix stays on one replica, a replica
that dies is drained. Each replica's /metrics tells which one served what."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.serve.data_parallel import healthy

ROUTER = shutil.which("vllm-router", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
if ROUTER is None:
    pytest.skip("the vllm-router executable is missing: it comes with the dev extra (pip install -e '.[dev]')",
                allow_module_level=True)

MODEL = "tiny-qwen3"
BLOCK_SIZE = 16  # the server's default: the prefix cache shares whole blocks only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """A process in a group of its own, so that stop() also ends whatever it started; its output goes to a file
    (a pipe nobody reads would fill up and block a server that logs every request)."""
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # 2 replicas + router on 2 cores


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    proc.wait(timeout=10)


def wait_for(ready, what: str, procs: list[tuple[subprocess.Popen, Path]], seconds: float = 120) -> None:
    """Poll ready() until it holds; fail with the log of any process that exited meanwhile."""
    deadline = time.monotonic() + seconds
    while True:
        for proc, log in procs:
            assert proc.poll() is None, f"{log.name} exited ({proc.returncode}): {log.read_text()[-3000:]}"
        try:
            if ready():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} after {seconds} s"
        time.sleep(0.2)


def served(url: str) -> int:
    """Requests a replica has finished (any finish reason), from its own /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("nanoserve:request_success_total{")))


def metric(url: str, name: str) -> int:
    """One series of a replica's /metrics (the first of that name)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise KeyError(name)


def cache_hits(url: str) -> int:
    return metric(url, "nanoserve:prefix_cache_hits_total")


def healthy_workers(router_url: str) -> int:
    reply = httpx.get(f"{router_url}/readiness")  # not 200 while it is not ready
    return reply.json()["healthy_workers"] if reply.status_code == 200 else 0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas, started together, each on its own port with a small KV pool."""
    logs = tmp_path_factory.mktemp("replicas")
    urls, procs = [], []
    try:
        for i in range(2):
            port, log = free_port(), logs / f"replica{i}.log"
            procs.append((start([sys.executable, "-m", "nanoserve.cli", "serve", MODEL, "--port", str(port),
                                 "--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "4",
                                 "--cpu-kv-cache-gib", "0.02"], log), log))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, f"{url} not healthy", procs)
        yield urls, [proc for proc, _ in procs]
    finally:
        for proc, _ in procs:
            stop(proc)


@pytest.fixture
def router(replicas, tmp_path):
    """router(policy): a vllm-router in front of both replicas, ready; its URL. Stopped after the test."""
    urls, _ = replicas
    started = []

    def launch(policy: str) -> str:
        port, log = free_port(), tmp_path / f"router_{policy}.log"
        # Health checks every second (the default is every 60 s), two failures to mark a worker unhealthy; its
        # Prometheus port too is free (the default, 29000, would collide with another router on this machine).
        proc = start([ROUTER, "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port),
                      "--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warning",
                      "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
                      "--health-failure-threshold", "2"], log)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy_workers(url) == len(urls), "the router did not see both replicas healthy",
                 [(proc, log)], seconds=60)
        return url

    yield launch
    for proc in started:
        stop(proc)


def complete(router_url: str, prompts: list[str]) -> list[str]:
    """One request at a time, so that no policy sees a load to balance; each raises if it fails."""
    api = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=60)
    return [api.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
            for p in prompts]


def test_round_robin_spreads_requests_over_both_replicas(replicas, router):
    urls, _ = replicas
    url = router("round_robin")
    before = [served(u) for u in urls]
    complete(url, [f"Request number {i}:" for i in range(8)])
    assert [served(u) - b for u, b in zip(urls, before)] == [4, 4]


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(replicas, router):
    urls, _ = replicas
    url = router("cache_aware")
    # Several full KV blocks long; the two prefixes share nothing at their start.
    a = ("You are a careful assistant for a small bakery. Answer in one short sentence, politely, and never invent "
         "prices or opening hours that you were not told about. The bakery sells bread and cakes. ")
    b = ("Translate the following English words into French, one word per line, with no comments, keeping the "
         "order in which they were given and the case of each word exactly as it is. ")
    before, hits = [served(u) for u in urls], [cache_hits(u) for u in urls]
    complete(url, [f"{a}Question {i}: what do you sell?" for i in range(6)])
    counts = [served(u) - n for u, n in zip(urls, before)]
    assert sorted(counts) == [0, 6], counts  # all six on one replica (round robin: three and three)
    home, other = counts.index(6), counts.index(0)
    # ... whose prefix cache gave the five after the first their shared blocks
    assert cache_hits(urls[home]) - hits[home] >= 5 * BLOCK_SIZE

    # While a long request of the first prefix keeps its replica busy, a new prefix goes to the idle replica and
    # stays there, and the first prefix still goes home though home is the busier one: the prefix decides, not
    # the load (least-loaded routing would send all nine to the idle replica) nor the order of the workers.
    long_request = {"model": MODEL, "prompt": f"{a}Tell a long story.", "max_tokens": 1800, "ignore_eos": True,
                    "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long_request, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator would close the stream, and so end the request
        next(lines)  # its first token: the router has sent it, and counts it as home's load
        before = [served(u) for u in urls]
        complete(url, [f"{b}Word {i}: bread" for i in range(6)])
        complete(url, [f"{a}Question {i}: do you bake on Sundays?" for i in range(3)])
        counts = [served(u) - n for u, n in zip(urls, before)]
        assert (counts[home], counts[other]) == (3, 6), counts  # the long request (1800 tokens) is still running


def test_a_replica_that_dies_is_drained(replicas, router):
    """Runs last: it kills one of the module's replicas."""
    urls, procs = replicas
    url = router("round_robin")
    survivor, dead = urls
    stop(procs[1])  # SIGKILL: no goodbye to the router
    before = served(survivor)
    # Before its health checks notice, the router retries a request that fails on the dead replica on the next
    # one (round robin): no client sees an error.
    complete(url, [f"Right after the loss, request {i}:" for i in range(4)])
    # Then its own view: two failed health checks mark the replica unhealthy (a generous limit for a busy machine)
    wait_for(lambda: any(w["url"] == dead and not w["is_healthy"] for w in httpx.get(f"{url}/workers").json()
                         ["workers"]), "the router still counts the dead replica healthy", [], seconds=60)
    complete(url, [f"After the loss, request {i}:" for i in range(8)])
    assert served(survivor) - before == 12


@pytest.mark.parametrize("stopped_by", ["SIGTERM", "Ctrl-C"])
def test_data_parallel_size_serves_replicas_behind_vllm_router(tmp_path, stopped_by):
    """`nanoserve serve --data-parallel-size 2`: two replicas on ports of their own, vllm-router (cache-aware) on
    the server's port. While one replica runs a long request, new prompts go to the other. SIGTERM to the server
    alone, or Ctrl-C in its terminal (SIGINT to every process of its group at once), stops the router and the
    replicas, and the server exits with its own status."""
    port, log = free_port(), tmp_path / "dp.log"
    proc = start([sys.executable, "-m", "nanoserve.cli", "serve", MODEL, "--data-parallel-size", "2", "--port",
                  str(port), "--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "4",
                  "--cpu-kv-cache-gib", "0.02"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy_workers(url) == 2, "the router did not see both replicas healthy", [(proc, log)],
                 seconds=180)
        workers = [w["url"] for w in httpx.get(f"{url}/workers").json()["workers"]]
        assert len(workers) == 2 and f"127.0.0.1:{port}" not in " ".join(workers)
        if stopped_by == "SIGTERM":
            routes_away_from_a_busy_replica(url, workers)
            proc.terminate()  # SIGTERM to `nanoserve serve` alone: it stops what it started
            assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        else:  # a terminal's Ctrl-C: SIGINT to its foreground group, the server, its replicas and the router
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=30) == 130
            assert "Traceback" not in log.read_text() and "nanoserve: interrupted" in log.read_text()
        deadline = time.monotonic() + 30
        while any(healthy(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(healthy(w) for w in workers), log.read_text()[-2000:]
    finally:
        stop(proc)


def routes_away_from_a_busy_replica(url: str, workers: list[str]) -> None:
    """While a long request runs on one replica, the router sends four new prompts to the other."""
    long_request = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1800, "ignore_eos": True,
                    "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long_request, timeout=60) as stream:
        lines = stream.iter_lines()
        next(lines)  # its first token: it runs on one replica
        busy = [metric(w, "vllm:num_requests_running") for w in workers]
        assert sorted(busy) == [0, 1], busy
        before = [served(w) for w in workers]
        complete(url, [f"{word} are" for word in ("Apples", "Quantum", "Zebras", "Violins")])
        counts = [served(w) - b for w, b in zip(workers, before)]
        assert counts[busy.index(0)] == 4 and counts[busy.index(1)] == 0, (busy, counts)

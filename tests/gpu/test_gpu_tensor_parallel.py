"""Tensor parallelism on two GPUs (NCCL): TP=2 gives TP=1's greedy tokens in float32 under chunked prefill and
preemption, with and without CUDA graphs; a worker killed mid-generate makes rank 0 raise within seconds; two
TP=2 engines at once on the same GPUs each give the tokens of one alone. Every engine runs in a process of its
own under a time limit (bench/tp_tokens.py, bench/tp_lifecycle.py), so a hang fails the test, with the
processes' stacks, instead of stopping the suite."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, this machine has {GPUS}")]

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(args: list[str], limit: float) -> str:
    """The script's output; past `limit` seconds every process of it prints its stacks and the test fails."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        out = proc.communicate(timeout=limit)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler: every process's stacks
        try:
            out = proc.communicate(timeout=5)[0]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{args[0]} hung for {limit} s:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_gives_tp1s_tokens_in_float32(tmp_path, eager):
    tokens = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        args = [str(BENCH / "tp_tokens.py"), "tiny-qwen3", str(tp), "float32", str(out), "--tight", "--limit", "150"]
        _run(args + (["--eager"] if eager else []), 180)
        found = json.loads(out.read_text())
        assert found["preemptions"] > 0  # the small pool did its job
        tokens[tp] = found["tokens"]
    assert tokens[2] == tokens[1]


def test_a_killed_worker_makes_rank_0_raise_within_seconds():
    out = _run([str(BENCH / "tp_lifecycle.py"), "--kill", "nccl"], 120)
    found = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert found["raised"] and "died" in found["raised"], out[-3000:]
    assert found["seconds_to_error"] < 30
    # after the loss, a new TP=2 engine either works (same tokens) or is refused with a reason
    assert found.get("new_llm_same_tokens") is True or "restart Python" in found.get("new_llm_refused", "")


def test_two_tp2_engines_at_once_give_the_tokens_of_one():
    procs = [subprocess.Popen([sys.executable, str(BENCH / "tp_lifecycle.py"), "--pair", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("two TP=2 engines at once hung")
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    tokens = [json.loads([line for line in o.splitlines() if line.startswith("RESULT ")][-1][7:])["tokens"]
              for o in outs]
    assert tokens[0] == tokens[1]

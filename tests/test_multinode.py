"""Tensor parallelism over two "nodes" on one CPU (lesson 07, section 7): node 0 is an LLM in this process
(rank 0, the engine), node 1 a headless `nanoserve serve` (rank 1, no server); they meet at a TCPStore on
127.0.0.1 and run their collectives over gloo. The flags are vLLM's."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.engine import tp_nodes
from nanoserve.model.zoo import resolve_model

SETTINGS = dict(device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=48, block_size=8)
PROMPTS = ["The capital of France is", [1, 2, 3, 4, 5], [(7 * i) % 900 + 50 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(port: int) -> subprocess.Popen:
    """Node 1 of 2, as a user starts it on the second machine."""
    return subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "tiny-qwen3", "--tensor-parallel-size",
                             "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                             str(port), "--headless"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def node_zero(port: int) -> LLM:
    return LLM("tiny-qwen3", tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
               master_port=port, **SETTINGS)


@pytest.mark.slow
def test_two_nodes_give_tp1s_greedy_tokens_and_the_node_exits_with_the_engine():
    port = free_port()
    node = start_node(port)  # before the engine, as it may be: it waits for node 0
    try:
        with LLM("tiny-qwen3", **SETTINGS) as llm:
            want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        with node_zero(port) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert node.poll() is None
        start = time.monotonic()
        assert node.wait(timeout=30) == 0, node.stderr.read()
        assert time.monotonic() - start < 10
        assert "node 1: the engine stopped" in node.stderr.read()
    finally:
        node.kill()
    assert got == want


@pytest.mark.slow
def test_a_killed_node_is_a_clear_error_within_seconds():
    port = free_port()
    node = start_node(port)
    llm = node_zero(port)
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # both ranks have built their runners: the kill hits steps
        threading.Timer(0.3, node.kill).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"node 1 \(rank 1, at 127\.0\.0\.1\) is gone: its connection closed"):
            llm.generate(PROMPTS * 8, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 5
        with pytest.raises(RuntimeError, match="shut down .*node 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
        node.kill()


def test_bad_flag_combinations_are_refused_by_name():
    for settings, message in [
        (dict(tensor_parallel_size=3, nnodes=2), "tensor_parallel_size 3 does not divide over nnodes 2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, headless=True), "node_rank must be below nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=1), "headless exactly when node_rank > 0"),
        (dict(tensor_parallel_size=2, nnodes=2, headless=True), "headless exactly when node_rank > 0"),
        (dict(tensor_parallel_size=2, nnodes=2, master_port=70000), "master_port a port"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineArgs("tiny-qwen3", **settings)
    with pytest.raises(ValueError, match="node_rank 1 runs no engine.*--headless"):  # an LLM is node 0's
        LLM("tiny-qwen3", tensor_parallel_size=2, nnodes=2, node_rank=1, headless=True, **SETTINGS)


def test_a_node_whose_flags_differ_from_node_zeros_is_told_why(tmp_path):
    """What a headless node checks before it joins (and tells node 0, which stops too)."""
    path = resolve_model("tiny-qwen3")
    setup = dict(size=2, nnodes=2, model=tp_nodes.fingerprint(path), device="cpu")
    assert tp_nodes.disagreement(setup, 2, 2, path, 1) is None
    assert "--tensor-parallel-size 4 --nnodes 2 differ from node 0's (2 and 2)" in tp_nodes.disagreement(
        setup, 4, 2, path, 2)
    (tmp_path / "config.json").write_text('{"hidden_size": 1}')
    assert "is not node 0's" in tp_nodes.disagreement(setup, 2, 2, tmp_path, 1)

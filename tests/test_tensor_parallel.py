"""Lesson 07's tensor parallelism on a CPU: two ranks over gloo (the main process and one spawned worker).

Greedy tokens with TP=2 must be TP=1's, in fp32, on three tiny random models (Qwen3; Qwen3 with one
K/V head, so it is replicated on both ranks, and a vocabulary that does not split evenly; a Llama-family
model with an untied LM head), under paging, chunked prefill, preemption and prefix caching at once.
Then the sliced loader, and the lifecycle: deaths, exceptions, exits, engines one after another and
side by side. Only one tensor-parallel engine runs in this process at a time (torch.distributed's
default group is per process), so each test shuts its engine down.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.model import loader
from nanoserve.model.loader import load_model
from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
from nanoserve.model.tp_layers import TPGroup
from nanoserve.model.offline_models import _write_random_qwen3, tiny_init, tiny_qwen3_config

# A shared 20-token prefix (5 blocks of 4: prefix caching shares them), then each prompt's own tokens.
PREFIX = [(7 * i + 3) % 5000 + 200 for i in range(20)]
PROMPTS = [PREFIX + [(11 * i + 17 * j) % 5000 + 300 for j in range(3 + 5 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
PARAMS = [GREEDY] * 7 + [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2)]  # n=2: a fork
# Small on purpose: prompts of 23-58 tokens prefill in chunks of 32; 40 blocks of 4 tokens cannot hold
# every sequence at full length, so some are preempted and recomputed.
ENGINE = dict(block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=40, max_num_seqs=8,
              max_model_len=128, enable_prefix_caching=True)


def tiny_config(**changes) -> dict:
    # tiny-qwen3's, with a small vocabulary (fast to build and load): the special tokens lie outside it
    return {**tiny_qwen3_config(), "vocab_size": 6000, "pad_token_id": None, "bos_token_id": None,
            "eos_token_id": None, **changes}


def build(dest: Path, llama: bool = False, **changes) -> Path:
    """A tiny random model (tiny-qwen3's init) with some config changes; llama: no q/k-norm, an untied head."""
    _write_random_qwen3(dest, tiny_config(**changes), tiny_init)
    if llama:
        weights = {n: t for n, t in load_file(dest / "model.safetensors").items()
                   if not n.endswith(("q_norm.weight", "k_norm.weight"))}
        weights["lm_head.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape,
                                                generator=torch.Generator().manual_seed(1)) * 0.1
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
        hf = json.loads((dest / "config.json").read_text())
        hf.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
        (dest / "config.json").write_text(json.dumps(hf))
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {"qwen3": build(root / "qwen3"),
            "one kv head, odd vocab": build(root / "kv1", num_key_value_heads=1, vocab_size=5999),
            "llama, untied": build(root / "llama", llama=True, num_attention_heads=8, num_key_value_heads=4,
                                   head_dim=16)}


def load_rank(path, rank: int, size: int):
    """One rank's share of the fused model, as lesson 01's loader reads it for a group (no collectives run)."""
    return load_model(path, torch.float32, "cpu", FusedQwen3ForCausalLM, group=TPGroup(rank, size))


def generate(path, **kw):
    """Tokens of every completion, the engine's stats and the number of prompt tokens found cached."""
    with LLM(str(path), **ENGINE, **kw) as llm:
        hits = []
        reserve = llm.cache.reserve
        llm.cache.reserve = lambda seq_id, ids: hits.append(reserve(seq_id, ids)) or hits[-1]
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [c.token_ids for o in outputs for c in o.outputs], llm.engine.stats, sum(hits)


@pytest.fixture(scope="module")
def tp1(models):
    """TP=1's results for each model, computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = generate(models[name])
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["qwen3", "one kv head, odd vocab", "llama, untied"])
def test_tp2_greedy_tokens_are_tp1s(models, tp1, name):
    want, stats, hits = tp1(name)
    assert stats.preemptions > 0 and hits > 0 and stats.prefill_steps > len(PROMPTS)  # every path ran
    got, tp_stats, tp_hits = generate(models[name], tensor_parallel_size=2)
    assert got == want
    assert (tp_stats.preemptions, tp_hits) == (stats.preemptions, hits)


def test_tp2_with_an_fp8_cache_gives_tp1s_fp8_tokens(models):
    """kv_cache_dtype reaches the workers: every rank keeps its heads' K/V in e4m3, so TP=2 gives TP=1's
    fp8 tokens (preemption, prefix hits and chunks included), not the float32 cache's."""
    want, stats, hits = generate(models["qwen3"], kv_cache_dtype="fp8")
    got, tp_stats, tp_hits = generate(models["qwen3"], kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert got == want and (tp_stats.preemptions, tp_hits) == (stats.preemptions, hits)


def test_two_tp_engines_one_after_another_with_async_scheduling(models, tp1):
    """Lesson 06's launch-ahead steps: the workers get the fed tokens by broadcast. A second engine
    starts in the same process once the first is shut down."""
    want, _, _ = tp1("qwen3")
    for _ in range(2):
        with LLM(str(models["qwen3"]), **ENGINE, tensor_parallel_size=2, async_scheduling=True) as llm:
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert llm.engine.stats.steps_ahead > 0
        assert [c.token_ids for o in outputs for c in o.outputs] == want


class ReadCounter:
    """Wraps safetensors' files and slices to count the elements a loader reads."""

    def __init__(self, monkeypatch):
        self.read = 0
        real_open = loader.open_weights
        counter = self

        class Slice:
            def __init__(self, inner):
                self.inner = inner

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                piece = self.inner[index]
                counter.read += piece.numel()
                return piece

        class File:
            def __init__(self, file, device="cpu"):
                self.f = real_open(file, device)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return Slice(self.f.get_slice(name))

            def get_tensor(self, name):  # a tensor read whole
                tensor = self.f.get_tensor(name)
                counter.read += tensor.numel()
                return tensor

        monkeypatch.setattr(loader, "open_weights", File)


@pytest.mark.parametrize("name, size", [("qwen3", 2), ("qwen3", 4), ("one kv head, odd vocab", 2),
                                        ("llama, untied", 2)])
def test_sliced_loader_reads_each_ranks_slices(models, name, size, monkeypatch):
    """Each rank's parameters are its slices of the full tensors (K/V heads replicated where there are
    fewer than ranks; the vocabulary's padding rows zero), and it reads about 1/size of the weights."""
    path = models[name]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}
    cfg = json.loads((path / "config.json").read_text())
    kv_heads, D = cfg["num_key_value_heads"], cfg["head_dim"]
    norms = sum(t.numel() for t in full.values() if t.dim() == 1)
    kv = sum(t.numel() for n, t in full.items() if "k_proj" in n or "v_proj" in n)
    split = sum(t.numel() for t in full.values()) - norms - kv  # everything else is cut in `size` slices
    # what one rank should read: its slices, its K/V heads (one replicated head if there are fewer than
    # ranks), every norm, and at most one row of vocabulary rounding
    most = split // size + kv * max(kv_heads // size, 1) // kv_heads + norms + cfg["hidden_size"]
    pieces: dict[str, list] = {}
    for rank in range(size):
        counter = ReadCounter(monkeypatch)
        model = load_rank(path, rank, size)
        assert 0 < counter.read <= most
        params = model.checkpoint_tensors()
        for n in full:
            pieces.setdefault(n, []).append(params[n])
        layer = "model.layers.1.self_attn."
        head = rank * kv_heads // size  # the K/V head this rank's query heads use (the first, if several)
        for proj in ("k_proj.weight", "v_proj.weight"):
            assert torch.equal(params[layer + proj][:D], full[layer + proj][head * D:(head + 1) * D])
        assert torch.equal(params[layer + "q_proj.weight"], full[layer + "q_proj.weight"].chunk(size)[rank])
    vocab = cfg["vocab_size"]
    for n, t in full.items():
        if "k_proj" in n or "v_proj" in n:
            continue  # checked above (replicated or split)
        part = n.rsplit(".", 2)[-2]
        dim = 1 if part in ("o_proj", "down_proj") else 0
        if t.dim() == 1:
            assert all(torch.equal(p, t) for p in pieces[n]), n
            continue
        joined = torch.cat(pieces[n], dim=dim)
        if part in ("embed_tokens", "lm_head"):
            assert not joined[vocab:].any()  # padding
            joined = joined[:vocab]
        assert torch.equal(joined, t), n


def test_sharded_checkpoint_loads_the_same_slices(models, tmp_path):
    """qwen3-8b-random's sharded layout (model-0000k-of-0000n + index), on the tiny model: same slices."""
    _write_random_qwen3(tmp_path, tiny_config(), tiny_init, shard_bytes=2**20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    for rank in range(2):
        whole = load_rank(models["qwen3"], rank, 2).state_dict()
        sharded = load_rank(tmp_path, rank, 2).state_dict()
        assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)


def test_uneven_splits_fail_clearly(models):
    with pytest.raises(ValueError, match="query heads .* tensor_parallel_size 3"):
        load_rank(models["qwen3"], 0, 3)
    with pytest.raises(ValueError, match="fused_ops=True"):
        LLM(str(models["qwen3"]), tensor_parallel_size=2, fused_ops=False)


def test_an_exception_in_generate_leaves_the_engine_usable(models, tp1):
    want, _, _ = tp1("qwen3")
    with LLM(str(models["qwen3"]), **ENGINE, tensor_parallel_size=2) as llm:
        runner = llm.engine.runner
        sampler = runner.sampler
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("sampler exploded")
            return sampler(*args)

        runner.sampler = failing
        with pytest.raises(RuntimeError, match="sampler exploded"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        runner.sampler = sampler
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [c.token_ids for o in outputs for c in o.outputs] == want


def test_a_killed_worker_is_a_clear_error_within_seconds(models):
    llm = LLM(str(models["qwen3"]), **{**ENGINE, "num_gpu_blocks_override": 400}, tensor_parallel_size=2)
    worker = llm.workers.procs[0]
    llm.generate([PREFIX], GREEDY, use_tqdm=False)  # the pool and the runners are built: the kill hits a step
    killer = threading.Timer(0.5, os.kill, (worker.pid, 9))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 .* died \(exit code -9\)"):
        llm.generate(PROMPTS * 8, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="shut down .*rank 1"):
        llm.generate([PREFIX], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not worker.is_alive()


SCRIPT = """
import sys
from nanoserve import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(llm.workers.procs[0].pid, out[0].outputs[0].token_ids, flush=True)
    # no shutdown(): the interpreter's exit must stop the worker
"""


def test_two_engines_side_by_side_and_exit_without_shutdown(models, tmp_path):
    """Two scripts on one host at once (each picks its own free port), exiting without shutdown():
    no worker survives them."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.Popen([sys.executable, str(script), str(models["qwen3"])], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [r.communicate(timeout=600) for r in runs]  # a bound for a hang, not a speed: loaded machines are slow
    for r, (out, err) in zip(runs, results):
        assert r.returncode == 0, err
    pids = [int(out.split()[0]) for out, _ in results]
    tokens = {out.split(None, 1)[1] for out, _ in results}
    assert len(tokens) == 1  # the same model, the same tokens
    time.sleep(0.5)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_group_left_to_a_hung_abort_is_named_by_the_next_engine(models, monkeypatch):
    """On two H200s NCCL's abort of a group whose worker died took over 30 s: shutdown leaves the group to
    the monitor's abort after 3 s (destroying it meanwhile deadlocked), and the next tensor-parallel engine
    in the process says why it cannot start."""
    import multiprocessing

    import torch.distributed as dist

    from nanoserve.engine import tp_workers

    assert type(tp_workers.tp_group(0, 2, torch.float32, torch.device("cpu"), True)) is TPGroup  # no one-shot on a CPU
    monkeypatch.setattr(tp_workers, "ABANDONED", [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wake, _ = multiprocessing.Pipe()
        start = time.monotonic()
        tp_workers.stop([], [], wake, threading.Event(), torch.get_num_threads())  # a monitor that never settles
        assert 3 <= time.monotonic() - start < 5 and dist.is_initialized()
        with pytest.raises(RuntimeError, match="lost a worker.*restart Python"):
            LLM(str(models["qwen3"]), **ENGINE, tensor_parallel_size=2)
    finally:
        dist.destroy_process_group()


def test_a_script_without_the_main_guard_is_told_what_to_do(tmp_path):
    """Spawned workers import the main module: one that makes a TP LLM at its top level kills them at start."""
    script = tmp_path / "script.py"
    script.write_text('from nanoserve import LLM\nLLM("tiny-qwen3", device="cpu", tensor_parallel_size=2)\n')
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "died" in last and 'if __name__ == "__main__":' in last, done.stderr[-2000:]

"""Checks for lesson 07 (tensor parallelism), on 2 ranks of a CPU: two processes joined by torch.distributed's
gloo backend. Oracles: the same layer unsharded (plain torch) and lesson 06's fused model, whole.

The code under test is usually defined in a notebook (`__main__`), which a freshly spawned process cannot
import. So `run_on_ranks` FORKS its ranks: each child starts as a copy of this process, notebook definitions
included. Where `fork` does not exist (Windows), the checks say so instead of running."""
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

TIMEOUT = 60  # seconds for every rank to finish; a rank stuck in a collective is killed after it


def _rank_main(rank: int, size: int, init_file: str, conn, fn, args) -> None:
    torch.set_num_threads(1)  # the ranks share the CPU's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        reply = ("ok", fn(rank, size, *args))
    except BaseException as e:
        reply = ("error", e, traceback.format_exc())
    # Plain pickle, by value: the pipe's own pickler would hand tensors over as shared memory that this
    # process must still be alive to serve, and it exits right after.
    try:
        data = pickle.dumps(reply)
    except Exception:  # an exception or result that does not pickle: its text still does
        data = pickle.dumps(("error", RuntimeError(repr(reply[1])), reply[2] if len(reply) > 2 else ""))
    conn.send_bytes(data)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_on_ranks(fn, *args, size: int = 2) -> list:
    """fn(rank, size, *args) in `size` forked processes that form a gloo process group; every rank's return
    value, in rank order. The first exception on any rank is raised here, with that rank's traceback; the
    other ranks (perhaps waiting for it in a collective) are then killed."""
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError("lesson 07's checks fork their ranks, so that they run this notebook's code; this "
                           "system cannot fork (Windows): run the lesson in WSL or on Linux/macOS")
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs, pending = [], {}  # pending: our end of each rank's pipe, until it has answered
        for rank in range(size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, size, os.path.join(tmp, "init"), theirs, fn, args),
                               daemon=True)
            proc.start()
            theirs.close()  # the rank's end lives in the rank only: its exit closes the pipe
            procs.append(proc)
            pending[ours] = rank
        results, failure, deadline = {}, None, time.monotonic() + TIMEOUT
        while pending and failure is None:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failure = (TimeoutError(f"ranks {sorted(pending.values())} did not finish in {TIMEOUT} s (waiting "
                                        f"in a collective that another rank never joined?)"), "")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # it died without a word (a crash)
                    reply = ("error", RuntimeError(f"rank {rank} died (exit code {procs[rank].exitcode})"), "")
                if reply[0] == "error":
                    failure = failure or (reply[1], f"on rank {rank}:\n{reply[2]}")
                else:
                    results[rank] = reply[1]
        for proc in procs:
            proc.join(0 if failure else 5)
            if proc.is_alive():  # waiting for a peer that failed: nothing left to save
                proc.kill()
                proc.join()
    if failure is not None:
        error, trace = failure
        raise error from RuntimeError(trace)
    return [results[rank] for rank in range(size)]


class CountingGroup:
    """Wraps a TP group to count its collectives (how many all-reduces a forward makes); `shard`: the cut that
    the loader's group.shard(model) runs, with this group in the layers."""

    def __init__(self, group, shard=None):
        self.group, self.all_reduces, self.all_gathers = group, 0, 0
        self.rank, self.size, self._shard = group.rank, group.size, shard

    def all_reduce(self, x):
        self.all_reduces += 1
        return self.group.all_reduce(x)

    def all_gather(self, x):
        self.all_gathers += 1
        return self.group.all_gather(x)

    def split(self, n, what):
        return self.group.split(n, what)

    def shard(self, model):
        return self._shard(model, self)


def _row_parallel_on_rank(rank, size, group_cls, row_cls):
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(6, 8, generator=gen)  # [out_features, in_features]: y = x @ full.T
    x = torch.randn(3, 8, generator=gen)
    group = CountingGroup(group_cls(rank, size))
    layer = row_cls(8, 6, group)
    cols = 8 // size
    if tuple(layer.weight.shape) != (6, cols):
        raise AssertionError(f"a row-parallel layer of 8 -> 6 features on {size} ranks holds a [6, {cols}] weight, "
                             f"got {tuple(layer.weight.shape)}")
    with torch.no_grad():
        layer.weight.copy_(full[:, rank * cols:(rank + 1) * cols])  # its columns: some input features
        y = layer(x[:, rank * cols:(rank + 1) * cols])  # and the matching slice of the input
    return y, group.all_reduces, x @ full.T


def check_row_parallel(group_cls, row_cls) -> None:
    for rank, (y, reduces, want) in enumerate(run_on_ranks(_row_parallel_on_rank, group_cls, row_cls)):
        if reduces != 1:
            raise AssertionError(f"rank {rank}: the forward made {reduces} all-reduces; it needs exactly one")
        if y.shape != want.shape or not torch.allclose(y, want, atol=1e-5):
            raise AssertionError(f"rank {rank}: output differs from the unsharded x @ W.T (max error "
                                 f"{(y - want).abs().max() if y.shape == want.shape else y.shape}). Each rank's "
                                 f"product is a partial sum: did you add them up across the ranks?")
    print("✓ RowParallelLinear: 2 ranks, each with half the input features, give x @ W.T on both, one all-reduce")


def _embedding_on_rank(rank, size, group_cls, embedding_cls, vocab):
    gen = torch.Generator().manual_seed(8)
    table = torch.randn(vocab, 4, generator=gen)
    ids = torch.tensor([0, vocab - 1, 5, 6, 2, 5, vocab // 2, vocab // 2 - 1, vocab // 2 + 1])
    group = CountingGroup(group_cls(rank, size))
    layer = embedding_cls(vocab, 4, group)
    rows = layer.weight.shape[0]
    with torch.no_grad():  # this rank's rows of the table, padded with junk past the vocabulary
        layer.weight.fill_(1e3)
        mine = table[rank * rows:(rank + 1) * rows]
        layer.weight[:len(mine)] = mine
        return layer(ids), group.all_reduces, table[ids]


def check_vocab_embedding(group_cls, embedding_cls) -> None:
    for vocab in (12, 11):  # 11: the second rank's last row is padding
        for rank, (got, reduces, want) in enumerate(run_on_ranks(_embedding_on_rank, group_cls, embedding_cls, vocab)):
            if reduces != 1:
                raise AssertionError(f"vocab {vocab}, rank {rank}: {reduces} all-reduces; the embedding needs one")
            if got.shape != want.shape or not torch.allclose(got, want):
                raise AssertionError(f"vocab {vocab}, rank {rank}: the embeddings differ from the full table's "
                                     f"(shape {tuple(got.shape)}, want {tuple(want.shape)}). Does each rank zero the "
                                     f"tokens it does not hold before the all-reduce?")
    print("✓ VocabParallelEmbedding: each rank looks up its own tokens, zeros the others; one all-reduce gives "
          "every token's row on both ranks (vocabularies of 12 and 11)")


def _tp_logits_on_rank(rank, size, group_cls, shard, model):
    from nanoserve.course.no_cache import NoCache
    from nanoserve.model.loader import load_model
    from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
    from nanoserve.model.zoo import resolve_model

    group = CountingGroup(group_cls(rank, size), shard)
    tp = load_model(resolve_model(model), torch.float32, "cpu", FusedQwen3ForCausalLM, group=group)
    ids = torch.arange(12) * 37 % 1000 + 5
    with torch.inference_mode():
        logits = tp.compute_logits(tp(ids, torch.arange(12), NoCache()))
    return logits, group.all_reduces


def check_checkpoint_slices(group_cls, shard, model: str = "tiny-qwen3") -> None:
    """shard(model, group): the cut and its slice plan (exercise 7.3's checkpoint_slices inside), loaded by
    lesson 01's load_model(..., group=...) on 2 ranks."""
    from transformers.utils import logging as transformers_logging

    from nanoserve.checks.lesson01 import hf_tiny_model
    from nanoserve.checks.lesson06 import tiny_qwen3_logits
    from nanoserve.model.loader import load_model
    from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
    from nanoserve.model.zoo import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        # A second checkpoint with one K/V head: at TP=2 both ranks must hold (replicate) that head.
        shown = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()  # its "Writing model shards" bar is not this check's output
        try:
            hf_tiny_model("Qwen3ForCausalLM", num_heads=4, num_kv_heads=1, head_dim=64, hidden=128, seed=4).save_pretrained(tmp)
        finally:
            if shown:
                transformers_logging.enable_progress_bar()
        for path, what in [(resolve_model(model), model), (tmp, "a model with 1 K/V head (replicated)")]:
            whole = load_model(path, dtype=torch.float32, device="cpu", model_cls=FusedQwen3ForCausalLM)
            want = tiny_qwen3_logits(whole)
            layers = whole.config.num_layers
            for rank, (logits, reduces) in enumerate(run_on_ranks(_tp_logits_on_rank, group_cls, shard,
                                                                  str(path))):
                if not torch.allclose(logits, want, atol=1e-4, rtol=1e-4):
                    raise AssertionError(
                        f"{what}, rank {rank}: TP=2 logits differ from the whole model's (max error "
                        f"{(logits - want).abs().max():.3g}). Which rows or columns does each weight give each rank: "
                        f"q/k/v/gate/up rows (output features), o/down columns (input features)? With fewer K/V "
                        f"heads than ranks, which K/V head do a rank's query heads use?")
                if reduces != 2 * layers + 1:
                    raise AssertionError(f"rank {rank}: {reduces} all-reduces in a forward; want 2 per layer "
                                         f"(o_proj, down_proj) + 1 (the embedding) = {2 * layers + 1}")
    print(f"✓ checkpoint_slices: {model} on 2 ranks gives the whole model's logits (float32) with "
          f"{2 * layers + 1} all-reduces per forward, and so does a model whose one K/V head both ranks hold")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "7.1 RowParallelLinear": lambda ns: check_row_parallel(ns["TPGroup"], ns["RowParallelLinear"]),
    "7.2 VocabParallelEmbedding": lambda ns: check_vocab_embedding(ns["TPGroup"], ns["VocabParallelEmbedding"]),
    "7.3 checkpoint_slices": lambda ns: check_checkpoint_slices(ns["TPGroup"], ns["shard"]),
}

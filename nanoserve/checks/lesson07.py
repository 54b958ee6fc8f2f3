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

from nanoserve.checks import RAISE_LIMIT, time_limit

TIMEOUT = 60  # seconds for every rank to finish (more with CHECK_TIMEOUT); a rank stuck in a collective is killed


def _rank_main(rank: int, size: int, init_file: str, conn, fn, args) -> None:
    torch.set_num_threads(1)  # the ranks share the CPU's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        dist.barrier()  # no rank goes on (and perhaps exits) while a peer is still connecting to it
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
        limit = time_limit(TIMEOUT)
        results, failure, deadline = {}, None, time.monotonic() + limit
        while pending and failure is None:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failure = (TimeoutError(f"ranks {sorted(pending.values())} did not finish in {limit:.0f} s, the "
                                        f"check's time limit: waiting in a collective that another rank never "
                                        f"joined? ({RAISE_LIMIT})"), "")
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
        return layer(ids), group.all_reduces, table[ids], ids, rows


def check_vocab_embedding(group_cls, embedding_cls) -> None:
    for vocab in (12, 11):  # 11: the second rank's last row is padding
        results = run_on_ranks(_embedding_on_rank, group_cls, embedding_cls, vocab)
        for rank, (got, reduces, want, ids, rows) in enumerate(results):
            if reduces != 1:
                raise AssertionError(f"{reduces} all-reduces, want one (vocab {vocab}, rank {rank})")
            if got.shape != want.shape:
                raise AssertionError(f"embeddings of shape {tuple(got.shape)}, want {tuple(want.shape)}: a row per "
                                     f"token (vocab {vocab}, rank {rank})")
            wrong = ~torch.isclose(got, want).all(-1)
            if wrong.any():
                raise AssertionError(f"tokens {sorted(set(ids[wrong].tolist()))} get wrong rows on rank {rank} "
                                     f"(vocab {vocab}: rank 0 holds tokens 0..{rows - 1}, rank 1 {rows}..{vocab - 1}). "
                                     f"Each rank looks up the tokens it holds, zeros the others, then one all-reduce "
                                     f"sums the ranks")
    print("✓ VocabParallelEmbedding: each rank looks up its own tokens, zeros the others; one all-reduce gives "
          "every token's row on both ranks (vocabularies of 12 and 11)")


def prompt_logits(model, vocab_size: int) -> torch.Tensor:
    """Logits of a 12-token prompt spread over the whole vocabulary (every rank's tokens), lesson 01's NoCache."""
    from nanoserve.course.no_cache import NoCache

    ids = (torch.arange(12) * 97 + 5) % vocab_size
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(12), NoCache()))


def _tp_logits_on_rank(rank, size, group_cls, shard, model):
    from nanoserve.model.loader import load_model
    from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM

    group = CountingGroup(group_cls(rank, size), shard)
    tp = load_model(model, torch.float32, "cpu", FusedQwen3ForCausalLM, group=group)
    return prompt_logits(tp, tp.full_config.vocab_size), group.all_reduces


def expected_slice(name: str, full: torch.Tensor, config, rank: int, size: int) -> tuple[torch.Tensor, str]:
    """The part of checkpoint tensor `name` (the whole of it: `full`) that rank `rank` of `size` must hold, and
    which part that is, in words. Worked out from the heads: a rank's query heads are the rank-th share of them,
    and its K/V heads are the ones those query heads use (one head, shared by several ranks, when there are
    fewer K/V heads than ranks)."""
    kind, D = name.rsplit(".", 2)[-2], config.head_dim
    heads = config.num_heads // size
    first_kv = rank * heads // (config.num_heads // config.num_kv_heads)  # the K/V head of its first query head
    kv = max(1, config.num_kv_heads // size)
    mlp = config.intermediate_size // size
    vocab = -(-config.vocab_size // size)
    queries = f"query heads {rank * heads}-{(rank + 1) * heads - 1}"
    kv_heads = f"K/V heads {first_kv}-{first_kv + kv - 1}" if kv > 1 else f"K/V head {first_kv}"
    cuts = {"q_proj": (0, rank * heads * D, heads * D, queries),
            "k_proj": (0, first_kv * D, kv * D, f"{kv_heads}, the one{'s' if kv > 1 else ''} its {queries} use"),
            "o_proj": (1, rank * heads * D, heads * D, f"the outputs of its {queries}"),
            "gate_proj": (0, rank * mlp, mlp, "its MLP features"),
            "down_proj": (1, rank * mlp, mlp, "its MLP features"),
            "embed_tokens": (0, rank * vocab, vocab, "its tokens")}
    cuts |= {"v_proj": cuts["k_proj"], "up_proj": cuts["gate_proj"], "lm_head": cuts["embed_tokens"]}
    if kind not in cuts:
        return full, "all of it"
    dim, start, n, what = cuts[kind]
    part = full.narrow(dim, start, min(n, full.shape[dim] - start))
    if part.shape[dim] < n:  # the last rank's vocabulary slice: zero padding past the last token
        part = torch.cat([part, part.new_zeros(n - part.shape[dim], *part.shape[1:])])
    span = f"{'rows' if dim == 0 else 'columns'} {start}..{start + part.shape[dim] - 1}"
    return part, f"{span} ({what})"


def _where_from(got: torch.Tensor, full: torch.Tensor) -> str:
    """Where in the whole tensor a rank's slice came from, as far as its first row or column tells."""
    if not got.any():
        return "only zeros (a slice that starts past the tensor's end?)"
    for dim in (0, 1):
        first = got.select(dim, 0)
        for i in range(full.shape[dim]):
            if first.shape == full.select(dim, i).shape and torch.equal(first, full.select(dim, i)):
                return f"{'rows' if dim == 0 else 'columns'} from {i}"
    return "values found nowhere in the checkpoint's tensor"


def check_slices(group_cls, shard, path, size: int, what: str) -> None:
    """Each rank of `size` loads its slices of the checkpoint at `path` through lesson 01's load_model and your
    shard (no collective runs: the loader only reads); every tensor must hold exactly its rank's part."""
    from nanoserve.model.loader import load_model
    from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM

    whole = load_model(path, dtype=torch.float32, device="cpu", model_cls=FusedQwen3ForCausalLM)
    full, config = whole.checkpoint_tensors(), whole.config
    for rank in range(size):
        group = CountingGroup(group_cls(rank, size), shard)
        try:
            parts = load_model(path, torch.float32, "cpu", FusedQwen3ForCausalLM, group=group).checkpoint_tensors()
        except NotImplementedError:  # a stub (a RuntimeError too)
            raise
        except (RuntimeError, ValueError) as e:
            raise AssertionError(f"{what}, rank {rank} of {size}: loading its slices failed "
                                 f"({type(e).__name__}: {e}). Does your plan give every cut weight a dimension "
                                 f"(0 or 1) and a start inside the tensor?") from e
        for name, got in parts.items():
            want, which = expected_slice(name, full[name], config, rank, size)
            if got.shape != want.shape or not torch.equal(got, want):
                raise AssertionError(f"{what}, rank {rank} of {size}: {name} should hold {which} of the checkpoint's "
                                     f"{tuple(full[name].shape)}, but holds {_where_from(got, full[name])}")


# Model shapes checked slice by slice: (query heads, K/V heads, head_dim, hidden, vocabulary, tied embeddings), TP.
ONE_KV_HEAD = (4, 1, 64, 128, 512, True)
NINE_BY_THREE = (9, 3, 16, 80, 511, False)
SHAPES = [((8, 4, 16, 64, 512, True), 2),  # 2 K/V heads per rank
          ((8, 4, 16, 64, 512, True), 4),  # 1 per rank
          (ONE_KV_HEAD, 2),  # the one K/V head on both ranks
          ((8, 2, 16, 64, 509, False), 4),  # 2 K/V heads, each on 2 of 4 ranks; the last rank's vocabulary padded
          (NINE_BY_THREE, 3)]  # 3 query heads and 1 K/V head per rank; an untied LM head


def _tiny_checkpoint(dest, heads, kv_heads, head_dim, hidden, vocab, tie, seed):
    from transformers.utils import logging as transformers_logging

    from nanoserve.checks.lesson01 import hf_tiny_model

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # its "Writing model shards" bar is not this check's output
    try:
        hf_tiny_model("Qwen3ForCausalLM", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                      vocab=vocab, tie=tie, seed=seed).save_pretrained(dest)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
    return dest


def check_checkpoint_slices(group_cls, shard, model: str = "tiny-qwen3") -> None:
    """shard(model, group): the cut and its slice plan (exercise 7.3's checkpoint_slices inside), loaded by
    lesson 01's load_model(..., group=...): each rank's slices for several shapes and tensor-parallel sizes, then
    the logits of a forward on 2 and 3 ranks against the whole model's."""
    from nanoserve.model.loader import load_model
    from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
    from nanoserve.model.zoo import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i, (shape, size) in enumerate(SHAPES):
            heads, kv_heads = shape[:2]
            what = f"{heads} query / {kv_heads} K/V head{'s' if kv_heads > 1 else ''} at TP={size}"
            paths[shape] = paths.get(shape) or _tiny_checkpoint(os.path.join(tmp, str(i)), *shape, seed=4 + i)
            check_slices(group_cls, shard, paths[shape], size, what)
        for path, size, what in [(resolve_model(model), 2, model), (paths[ONE_KV_HEAD], 2, "1 K/V head at TP=2"),
                                 (paths[NINE_BY_THREE], 3, "9 query / 3 K/V heads at TP=3")]:
            whole = load_model(path, dtype=torch.float32, device="cpu", model_cls=FusedQwen3ForCausalLM)
            want = prompt_logits(whole, whole.config.vocab_size)
            layers = whole.config.num_layers
            for rank, (logits, reduces) in enumerate(run_on_ranks(_tp_logits_on_rank, group_cls, shard, str(path),
                                                                  size=size)):
                if not torch.allclose(logits, want, atol=1e-4, rtol=1e-4):
                    raise AssertionError(
                        f"{what}, rank {rank}: TP={size} logits differ from the whole model's (max error "
                        f"{(logits - want).abs().max():.3g}), though every rank's slices are right: do the "
                        f"row-parallel layers and the embedding of exercises 7.1 and 7.2 sum over the ranks?")
                if reduces != 2 * layers + 1:
                    raise AssertionError(f"{what}, rank {rank}: {reduces} all-reduces in a forward; want 2 per layer "
                                         f"(o_proj, down_proj) + 1 (the embedding) = {2 * layers + 1}")
    print(f"✓ checkpoint_slices: every rank holds its slice of every tensor, for 5 shapes at TP=2, 3 and 4 (1 to 4 "
          f"K/V heads, a head on several ranks when there are fewer than the ranks); {model} and a model with 1 K/V "
          f"head on 2 ranks, and 9 query / 3 K/V heads on 3 ranks, give the whole model's logits, 2 all-reduces "
          f"per layer + 1")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "7.1 RowParallelLinear": lambda ns: check_row_parallel(ns["TPGroup"], ns["RowParallelLinear"]),
    "7.2 VocabParallelEmbedding": lambda ns: check_vocab_embedding(ns["TPGroup"], ns["VocabParallelEmbedding"]),
    "7.3 checkpoint_slices": lambda ns: check_checkpoint_slices(ns["TPGroup"], ns["shard"]),
}

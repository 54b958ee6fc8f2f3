"""Tensor parallelism's processes: rank 0 is the main process (it schedules and samples); ranks
1..N-1 are worker processes that hold their slice of the model and of every KV block, and run every
forward step in lockstep with rank 0.

Each rank runs the same forward on its own device; the collectives inside it (model/tp_layers.py) go
over torch.distributed: NCCL between GPUs (rank r on cuda:r), gloo on a CPU (every rank on the CPU).

The protocol: rank 0 talks to each worker over its own pipe (multiprocessing's Connection: pickled
tuples). Rank 0 sends
    ("kv", measure)                  how many KV blocks fit on your device? measure(device=...) says -> ("kv", n)
    ("build", num_blocks, runner_args)  allocate your KV pool (the same num_blocks on every rank)
    ("capture", sizes)               record your CUDA graphs, for these decode batch sizes
    ("step", arrays, scalars, fed, copies)  run one forward
    ("stop",)                        return: destroy the process group and exit
and a worker sends ("hello",) once started, ("ready",) once its slice is loaded, ("kv", n), and
("error", traceback) if anything fails before it exits. A step has no reply: it is answered by
joining rank 0's collectives. Its `arrays` are the rows of rank 0's step-metadata host buffer (lesson
02's builder) that this step uses: each rank copies them to its own device and runs the same forward
(a CUDA graph replay for decode). `fed`: the step's input ids are the tokens rank 0 sampled in the
previous step, still on rank 0's GPU (lesson 06's async scheduling): they arrive by a broadcast over
the device group. `copies`: KV blocks that a fork copied on rank 0 since the last step (each rank
copies its own heads).

Lifecycle. Workers are daemon processes started with `spawn`; they ignore Ctrl-C (rank 0 handles it)
and exit on ("stop",), or as soon as rank 0's process is gone. In rank 0 a monitor thread waits on
the workers' process sentinels: a worker that dies is reported by name within moments, instead of
leaving rank 0 inside a collective that will never complete. On NCCL rank 0 never blocks in a plain
CUDA sync: it polls an event while watching the monitor, and aborts the process group if a worker
died. Shutdown (llm.shutdown(), or a finalizer at garbage collection or interpreter exit) stops the
workers, kills those that do not stop within seconds and destroys the process group, so another
tensor-parallel LLM can start in the same process.

`spawn` starts each worker as a fresh Python that imports the main script's module: a script that
makes a tensor-parallel LLM must do so under `if __name__ == "__main__":` (as with vLLM).
"""
import gc
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.cache.metadata import StepMetadata, StepMetadataBuilder
from nanoserve.cache.paged import PagedKVCache
from nanoserve.cache.prefix import PrefixCachingKVCache
from nanoserve.engine.cuda_graphs import GraphModelRunner, padded_size
from nanoserve.engine.overlap import OverlappedModelRunner
from nanoserve.model.qwen3_tp import load_tp_model
from nanoserve.model.tp_layers import TPGroup

ROWS = ("input_ids", "positions", "slot_mapping")  # one entry per token of the step
SEQ_ROWS = ("context_lens",)  # one per sequence


# ----------------------------------------------------------------------------
# Both sides: the process group, and a step's metadata as it travels


def device_of(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def join_group(store, rank: int, size: int, device: torch.device) -> None:
    """Join the default process group: NCCL between GPUs, gloo on a CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        # The ranks share the CPU's cores: more threads than cores, and each rank's idle threads
        # spin while another rank's need the core (a TP=2 step on 2 cores ran ~10x slower).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))


def step_arrays(builder: StepMetadataBuilder, meta: StepMetadata) -> tuple[dict, tuple]:
    """The host rows of the builder that `meta` uses (what a worker needs to rebuild it), and its scalars."""
    h, T, S = builder.h, meta.input_ids.shape[0], meta.context_lens.shape[0]
    arrays = {name: h[name][:T].copy() for name in ROWS}
    arrays.update({name: h[name][:S].copy() for name in SEQ_ROWS})
    arrays["cu_seqlens_q"] = h["cu_seqlens_q"][:S + 1].copy()
    arrays["sample_rows"] = h["sample_rows"][:meta.sample_rows.shape[0]].copy()
    arrays["block_tables"] = h["block_tables"][:S, :meta.block_tables.shape[1]].copy()
    return arrays, (meta.is_decode, meta.max_context_len, meta.max_query_len)


def load_step(builder: StepMetadataBuilder, arrays: dict, scalars: tuple, pad=None) -> StepMetadata:
    """step_arrays' inverse, on this rank's builder: write the rows, copy them to the device, and view
    them as StepMetadata. pad(n): fill the padding rows of a graph's batch, as rank 0 did."""
    h, d = builder.h, builder.d
    T, S = len(arrays["input_ids"]), len(arrays["context_lens"])
    for name in (*ROWS, *SEQ_ROWS, "cu_seqlens_q", "sample_rows"):
        h[name][:len(arrays[name])] = arrays[name]
    tables = arrays["block_tables"]
    h["block_tables"][:S, :tables.shape[1]], h["block_tables"][:S, tables.shape[1]:] = tables, -1
    if pad is not None:
        pad(S)
    if builder.dev is not builder.host:
        builder.dev.copy_(builder.host, non_blocking=True)
    return StepMetadata(d["input_ids"][:T], d["positions"][:T], d["slot_mapping"][:T],
                        d["block_tables"][:S, :tables.shape[1]], d["context_lens"][:S], d["cu_seqlens_q"][:S + 1],
                        d["sample_rows"][:len(arrays["sample_rows"])], *scalars)


def copy_blocks(cache: PagedKVCache, copies: list[tuple[int, int]]) -> None:
    for src, dst in copies:
        cache.k_cache[:, dst] = cache.k_cache[:, src]
        cache.v_cache[:, dst] = cache.v_cache[:, src]


# ----------------------------------------------------------------------------
# A worker: ranks 1..N-1


class WorkerRunner(GraphModelRunner):
    """A worker's model runner: no scheduler, no sampling; rank 0 sends every step."""

    def __init__(self, model, cache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        # no graphs yet: rank 0 says when to record them (after its warm-up) and for which sizes
        super().__init__(model, cache, max_num_seqs, max_num_batched_tokens, max_model_len, cuda_graphs=False)
        self.copied = None  # an event: the last step's inputs have left the (pinned) host buffer

    def warm_up(self) -> None:
        """Nothing of its own: rank 0's warm-up steps arrive as ordinary steps."""

    def record_graphs(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.capture()

    @torch.inference_mode()
    def step(self, arrays: dict, scalars: tuple, fed: bool, copies: list) -> None:
        copy_blocks(self.cache, copies)
        n = len(arrays["context_lens"])
        size = padded_size(n, self.sizes) if scalars[0] else None  # scalars[0]: a decode step
        if self.copied is not None:  # rank 0 may send a step before our GPU has copied the last one's inputs
            self.copied.synchronize()
        meta = load_step(self.builder, arrays, scalars, pad=(lambda n: self.pad(n, size)) if size else None)
        self.copied = record_event(meta.input_ids)
        if fed:  # this step's tokens were sampled on rank 0's device, one step ago
            dist.broadcast(meta.input_ids, src=0)
        self.forward(meta)  # its logits are rank 0's business


def watch_parent() -> None:
    """Exit as soon as rank 0's process is gone, even from inside a collective that will never end."""
    multiprocessing.connection.wait([mp.parent_process().sentinel])
    os._exit(1)


def worker_main(rank: int, size: int, conn, port: int, path: str, dtype: torch.dtype, device_type: str,
                compiled: bool) -> None:
    """A worker process's whole life: join the group, load its slice, then serve rank 0's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which then stops us
    threading.Thread(target=watch_parent, daemon=True).start()
    if compiled:  # a daemon process may not start children: torch.compile compiles in this process
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1
    try:
        device = device_of(device_type, rank)
        conn.send(("hello",))
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        join_group(store, rank, size, device)
        model = load_tp_model(path, TPGroup(rank, size), dtype, device, compiled)
        conn.send(("ready",))
        serve(conn, model, device)
    except (EOFError, BrokenPipeError):
        pass  # rank 0 is gone: nobody to report to
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(conn, model, device: torch.device) -> None:
    runner = None
    while True:
        kind, *args = conn.recv()  # EOFError once rank 0 has closed its end
        if kind == "stop":
            return
        if kind == "kv":
            measure, = args
            conn.send(("kv", measure(device=device)))
        elif kind == "build":
            num_blocks, runner_args = args
            dtype = model.lm_head.weight.dtype
            cache = PagedKVCache(model.config, num_blocks, runner_args.pop("block_size"), dtype, device)
            runner = WorkerRunner(model, cache, **runner_args)
        elif kind == "capture":
            runner.record_graphs(*args)
        elif kind == "step":
            runner.step(*args)
        else:
            raise ValueError(f"unknown command {kind!r} from rank 0")


# ----------------------------------------------------------------------------
# Rank 0


class SharedForks:
    """Rank 0's KV cache, remembering the block copies its forks make (lesson 05's n > 1 completions):
    every worker makes the same copies in its own pool before the next step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending_copies: list[tuple[int, int]] = []  # sent with the next step, then cleared

    def fork(self, parent: int, child: int, num_tokens: int) -> None:
        copy = self.block_manager.fork(parent, child, num_tokens)
        if copy is not None:
            copy_blocks(self, [copy])
            self.pending_copies.append(copy)


class TPPagedKVCache(SharedForks, PagedKVCache):
    pass


class TPPrefixCachingKVCache(SharedForks, PrefixCachingKVCache):
    pass


class TPWorkers:
    """Rank 0's side: starts the workers, loads rank 0's slice (`.model`), sends steps, watches for
    deaths, and shuts everything down."""

    def __init__(self, path, dtype: torch.dtype, device: torch.device, size: int, compiled: bool):
        gc.collect()  # a tensor-parallel LLM dropped without shutdown() gives its process group back now
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: shut the other "
                               "tensor-parallel LLM down first (llm.shutdown())")
        if device.type == "cuda" and (device.index or 0) != 0:
            raise ValueError(f"with tensor parallelism rank r runs on cuda:r: pass device='cuda', not {device}")
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
        self.size, self.device = size, device_of(device.type, 0)
        self.failures: list[str] = []  # written by the monitor thread
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: any free port
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"nanoserve-tp-rank{rank}", daemon=True,
                               args=(rank, size, theirs, store.port, str(path), dtype, device.type, compiled))
            proc.start()
            theirs.close()  # the worker's end lives in the worker only: its exit closes the pipe
            self.procs.append(proc)
            self.conns.append(ours)
        self._wake, wake = ctx.Pipe()
        threading.Thread(target=monitor, args=(self.procs, wake, self.failures, device.type == "cuda"),
                         daemon=True).start()
        self.closed = None  # why the group cannot run steps any more, once it cannot
        self._finalizer = weakref.finalize(self, stop, self.procs, self.conns, self._wake, torch.get_num_threads())
        try:
            self.replies("hello")
            join_group(store, 0, size, self.device)
            self.model = load_tp_model(path, TPGroup(0, size), dtype, self.device, compiled)
            self.replies("ready")
        except BaseException:
            self.shutdown()
            raise

    # -- talking to the workers

    def send(self, message: tuple) -> None:
        self.check()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except OSError as e:  # a broken pipe: that worker is gone
                self.fail(e)

    def replies(self, kind: str) -> list:
        """Each worker's next message, which must be `kind`; a worker that fails or dies meanwhile raises."""
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            multiprocessing.connection.wait([conn, proc.sentinel])
            if not conn.poll():
                self.fail(None)
            reply = conn.recv()
            if reply[0] == "error":
                self.shutdown()
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{reply[1]}")
            if reply[0] != kind:
                raise RuntimeError(f"worker rank {rank} answered {reply[0]!r}, expected {kind!r}")
            out.append(reply[1:])
        return out

    @staticmethod
    def kv_cache_class(cache_cls):
        """Rank 0's version of a lesson 03/04 KV cache class (its forks' copies reach the workers)."""
        return {PagedKVCache: TPPagedKVCache, PrefixCachingKVCache: TPPrefixCachingKVCache}[cache_cls]

    def fewest_kv_blocks(self, own: int, measure) -> int:
        """How many KV blocks every rank can hold: the smallest number any rank has room for. measure(device)
        counts the blocks that fit on a device (every rank's blocks have the same size)."""
        self.send(("kv", measure))
        return min([own] + [n for n, in self.replies("kv")])

    def runner(self, model, cache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
               sampler, cuda_graphs: bool) -> "TPModelRunner":
        """Every worker builds its KV pool and runner; then rank 0's (whose warm-up steps they run too)."""
        self.send(("build", cache.block_manager.num_blocks,
                   dict(block_size=cache.block_size, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)))
        return TPModelRunner(self, model, cache, max_num_seqs, max_num_batched_tokens, max_model_len, sampler,
                             cuda_graphs=cuda_graphs)

    # -- deaths and failures

    def check(self) -> None:
        if self.closed is not None:
            raise RuntimeError(f"this tensor-parallel engine is shut down ({self.closed}); create a new LLM")

    def fail(self, error: BaseException | None):
        """A step or a message failed: if a worker died, say which (waiting a moment for the monitor to
        see it); either way the ranks are no longer in step, so shut everything down and raise."""
        deadline = time.monotonic() + 3
        while not self.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.failures and error is not None:
            self.shutdown(f"a step failed on rank 0 ({type(error).__name__})")
            raise error
        reason = self.failures[0] if self.failures else "a worker stopped answering"
        for conn in self.conns:  # a worker that failed (rather than was killed) said why before exiting
            try:
                message = conn.recv() if conn.poll() else None
            except EOFError:  # closed without a word: killed
                message = None
            if message is not None and message[0] == "error":
                reason += f"; its error:\n{message[1]}"
        self.shutdown(reason)
        raise RuntimeError(reason) from error

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Wait for the device to pass `event` (None: a CPU, nothing to wait for), watching the workers:
        a rank that died would leave the device waiting in a collective forever."""
        if event is not None:
            while not event.query():
                if self.failures:
                    self.fail(None)
                time.sleep(20e-6)
        if self.failures:
            self.fail(None)

    def shutdown(self, reason: str = "shut down") -> None:
        if self.closed is None:
            self.closed = reason
            self._finalizer()


def monitor(procs: list, wake, failures: list, abort_on_death: bool) -> None:
    """The monitor thread: wait until a worker exits, or until shutdown wakes it."""
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs, 1)}
    ready = multiprocessing.connection.wait([wake, *sentinels])
    if wake in ready:
        return  # shutdown: a worker exiting now is expected
    for s in ready:
        proc = procs[sentinels[s] - 1]
        proc.join()
        failures.append(f"tensor-parallel worker rank {sentinels[s]} ({proc.name}, pid {proc.pid}) died "
                        f"(exit code {proc.exitcode})")
    if abort_on_death and dist.is_initialized():  # NCCL: rank 0's kernels wait for the dead rank; abort ends them
        dist.distributed_c10d._abort_process_group()


def stop(procs: list, conns: list, wake, num_threads: int) -> None:
    """Stop the workers (politely, then by force), leave the process group, and give rank 0 back the
    threads it had before (join_group shares them out on a CPU)."""
    for conn in (wake, *conns):  # wake: the monitor returns, as the exits that follow are no deaths
        try:
            conn.send(("stop",))
        except OSError:
            pass  # already gone (a monitor that saw a death has returned, and closed its end)
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():  # stuck, e.g. in a collective rank 0 left: there is nothing left to save
            proc.kill()
            proc.join()
    for conn in (*conns, wake):
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(num_threads)


class TPModelRunner(OverlappedModelRunner):
    """Rank 0's model runner: every forward is first sent to the workers, and run on every rank at once.
    Lesson 06's launch-ahead works too: a step fed from the previous step's tokens broadcasts them."""

    def __init__(self, workers: TPWorkers, *args, **kwargs):
        self.workers, self.launching, self.fed = workers, False, False
        super().__init__(*args, **kwargs)

    def capture(self) -> None:
        self.workers.send(("capture", self.sizes))  # the workers record theirs at the same time, in step
        super().capture()

    def launch(self, batch, step, sample_steps, feed=None, rows=None):
        self.launching, self.fed = True, feed is not None
        try:
            return super().launch(batch, step, sample_steps, feed, rows)
        finally:
            self.launching = self.fed = False

    def forward(self, meta: StepMetadata) -> torch.Tensor:
        copies, self.cache.pending_copies = self.cache.pending_copies, []
        self.workers.send(("step", *step_arrays(self.builder, meta), self.fed, copies))
        try:
            if self.fed:
                dist.broadcast(meta.input_ids, src=0)
            logits = super().forward(meta)
            if not self.launching:  # the sampler reads them next: wait here, watching the workers
                self.workers.wait(record_event(logits))
            return logits
        except BaseException as e:  # the ranks are out of step now (a death, an error, Ctrl-C)
            self.workers.fail(e)

    def collect(self, launched) -> list[int]:
        self.workers.wait(launched.done)
        return super().collect(launched)


def record_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event

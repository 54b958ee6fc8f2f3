"""An asyncio front for the engine: one step loop, and an async stream of outputs per request.

The design, in one paragraph. LLMEngine is not thread-safe, so exactly one asyncio task, the step
loop, ever touches it. Between two steps that task admits new requests (engine.add_request) and
applies aborts (scheduler.abort); then it runs one engine.step() in a single worker thread
(run_in_executor), so the event loop stays free to accept connections and write bytes to clients
while the model computes. When the step returns, the same task hands every new token to the queue
of the request it belongs to. Requests, aborts and shutdown only append to plain lists and wake the
loop up; they never call the engine themselves. So no locks are needed: the engine is used by one
task at a time, and everything else happens on the event loop's thread.

An abort (a client that went away, a shutdown) takes effect before the next step starts: the
sequence leaves the scheduler's queues and gives its KV blocks back, so they are free within one step.
"""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.sequence import Sequence, SequenceStatus


class QueueFull(RuntimeError):
    """The server already holds as many requests as it may: try again later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down (or its loop died): it takes no more requests (HTTP 503)."""


@dataclass
class Delta:
    """One new token of one completion, as the step loop hands it to the request's consumer."""
    index: int  # which of the request's n completions
    token_id: int
    text: str  # the text this token made final (streams only; "" otherwise)
    logprobs: dict | None  # {token id: log-prob} of this step (the chosen token and the top k), if asked for
    finish_reason: str | None  # "stop" or "length" on the completion's last token, else None


class RequestStream:
    """One request's outputs: iterate it with `async for delta in stream`. Its owner must call
    stream.abort() when it stops reading early (abort does nothing once the request has finished)."""

    def __init__(self, engine: "AsyncEngine", prompt_ids: list[int], params: SamplingParams, stream_text: bool):
        self.engine, self.prompt_ids, self.params, self.stream_text = engine, prompt_ids, params, stream_text
        self.seqs: list[Sequence] = []  # the request's n sequences, once the step loop has added it
        self.accepted = asyncio.get_running_loop().create_future()  # done when added, or failed to be
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.num_unfinished = params.n
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: dict[int, float] = {}  # completion index -> when its last token came (ITL)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    async def __aiter__(self):
        while not (self.finished and self.queue.empty()):  # tokens delivered before it finished come first
            item = await self.queue.get()
            if isinstance(item, BaseException):  # the engine failed or stopped: the request ends with it
                raise item
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self)


class AsyncEngine:
    """Serves many concurrent callers from one LLM. Create it inside a running event loop, then
    `stream = await engine.add_request(ids, params)` and `async for delta in stream`."""

    def __init__(self, llm, max_waiting_requests: int = 256, metrics=None):
        self.engine = llm.engine  # llm.engine builds the KV pool now, not at the first request
        self.max_requests = self.engine.scheduler.max_num_seqs + max_waiting_requests
        self.metrics = metrics
        self.requests: set[RequestStream] = set()  # accepted or about to be, not finished
        self.to_add: list[RequestStream] = []
        self.to_abort: list[RequestStream] = []
        self.by_seq: dict[int, RequestStream] = {}  # seq_id -> its request
        self.stopping = False
        self.wake = asyncio.Event()  # set whenever the step loop has something new to do
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-step")
        self.loop_task = asyncio.get_running_loop().create_task(self.run())

    @property
    def alive(self) -> bool:
        return not self.loop_task.done() and not self.stopping

    async def add_request(self, prompt_ids: list[int], params: SamplingParams, stream_text: bool = False):
        """Queue a request and wait until the step loop has added it. Raises QueueFull or EngineStopped
        at once, and ValueError if the engine rejects the request (say, a prompt that is too long)."""
        if not self.alive:
            raise EngineStopped("the server is shutting down")
        if len(self.requests) >= self.max_requests:
            raise QueueFull(f"the server holds {len(self.requests)} requests already; retry later")
        stream = RequestStream(self, prompt_ids, params, stream_text)
        self.requests.add(stream)
        self.to_add.append(stream)
        self.wake.set()
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the caller went away while it waited
            stream.abort()
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.to_abort.append(stream)
        self.wake.set()

    def stop(self) -> None:
        """Begin shutting down: every request in flight ends with EngineStopped; new ones are refused.
        Safe to call from a signal handler through loop.call_soon_threadsafe."""
        self.stopping = True
        self.wake.set()

    async def close(self) -> None:
        self.stop()
        await asyncio.gather(self.loop_task, return_exceptions=True)
        self.executor.shutdown(wait=True)

    # The step loop: the only code that calls the engine.

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.stopping:
                self._admit()
                self._apply_aborts()
                self._report()
                if not self.engine.has_unfinished():
                    self.wake.clear()
                    await self.wake.wait()  # idle until a request, an abort or a stop comes
                    continue
                try:
                    outputs = await loop.run_in_executor(self.executor, self.engine.step)
                except Exception as e:  # a failed step fails the requests in it; the server goes on
                    self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                    continue
                self._deliver(outputs)
        finally:
            self.stopping = True
            self._fail_all(EngineStopped("the server is shutting down"))
            self._report()

    def _admit(self) -> None:
        adding, self.to_add = self.to_add, []
        for stream in adding:
            if stream.accepted.done():  # its caller went away before we got to it
                self.requests.discard(stream)
                continue
            try:
                first = self.engine.add_request(stream.prompt_ids, stream.params)
            except ValueError as e:
                self.requests.discard(stream)
                stream.accepted.set_exception(e)
                continue
            stream.seqs = [first, *first.forks]
            for seq in stream.seqs:
                if stream.stream_text:
                    seq.stream_text()  # make each token's text as it comes
                self.by_seq[seq.seq_id] = stream
            stream.accepted.set_result(None)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(stream.prompt_ids))

    def _apply_aborts(self) -> None:
        aborting, self.to_abort = self.to_abort, []
        for stream in aborting:
            if not stream.accepted.done():
                stream.accepted.cancel()  # not added yet: _admit will skip it
            self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Take a request out of the engine (its blocks back to the pool) and out of our books."""
        for seq in stream.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.engine.scheduler.abort(seq)
            self.by_seq.pop(seq.seq_id, None)
        stream.num_unfinished = 0
        self.requests.discard(stream)

    def _fail_all(self, error: Exception) -> None:
        for stream in list(self.requests):
            if not stream.accepted.done():
                stream.accepted.set_exception(error)
            else:
                stream.queue.put_nowait(error)
            self._forget(stream)
        self.to_add.clear()

    def _deliver(self, outputs: list[tuple[Sequence, int | None]]) -> None:
        now = time.perf_counter()
        for seq, token in outputs:
            stream = self.by_seq.get(seq.seq_id)
            if token is None or stream is None:  # a prompt chunk, or a request aborted meanwhile
                continue
            logprobs = seq.logprobs[-1] if seq.logprobs is not None else None
            stream.queue.put_nowait(Delta(seq.index, token, seq.new_text if stream.stream_text else "", logprobs,
                                          seq.finish_reason))
            self._time_token(stream, seq.index, now)
            if seq.finish_reason is not None:
                self.by_seq.pop(seq.seq_id)
                stream.num_unfinished -= 1
                if stream.finished:
                    self.requests.discard(stream)
                    if self.metrics:
                        self.metrics.request_finished(now - stream.arrival, seq.finish_reason)

    def _time_token(self, stream: RequestStream, index: int, now: float) -> None:
        """Time to first token (per request) and inter-token latency (per completion)."""
        if self.metrics is None:
            return
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.time_to_first_token.observe(now - stream.arrival)
        elif index in stream.last_token_at:
            self.metrics.inter_token_latency.observe(now - stream.last_token_at[index])
        stream.last_token_at[index] = now
        self.metrics.generation_tokens.inc()

    def _report(self) -> None:
        """The gauges: requests running and waiting, and the share of KV blocks held by requests."""
        if self.metrics is None:
            return
        scheduler, pool = self.engine.scheduler, self.engine.cache.block_manager
        self.metrics.num_requests_running.set(len(scheduler.running))
        self.metrics.num_requests_waiting.set(len(scheduler.waiting) + len(self.to_add))
        # num_free counts cached-but-evictable blocks (prefix caching) as free: no request holds them
        self.metrics.kv_cache_usage_perc.set(1 - pool.num_free / pool.num_blocks)

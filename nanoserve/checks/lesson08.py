"""Checks for lesson 08 (serving), all on a CPU in seconds. Oracles: LLM.generate on the same engine (the
tokens and text each request must get), the block pool's free count (an abort gives every block back), and
the Server-Sent Events format as a client parses it."""
import asyncio
import json
import logging
import threading

from nanoserve.checks import RAISE_LIMIT, time_limit
from nanoserve.serve.metrics import ServerMetrics

MODEL = "tiny-qwen3"


ENGINES: list = []  # the engines a check's event loop made: stopped from outside if that loop hangs


def _run(main, seconds: float = 90):
    """asyncio.run(main()) in a thread of its own: Jupyter's kernel already runs an event loop in this one.
    A step loop that never awaits (it spins) blocks that event loop, and no timeout inside it can fire:
    after `seconds` the engines are told to stop from here, and the check fails."""
    result, seconds = {}, time_limit(seconds)

    def target():
        try:
            result["value"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread below
            result["error"] = e

    ENGINES.clear()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for engine in ENGINES:
            engine.stopping = True  # a spinning `while not self.stopping` loop ends
        thread.join(10)
        raise AssertionError(f"the check's event loop was still busy after {seconds:.0f} s, the check's time "
                             f"limit: does the step loop await something on every turn? (Event.wait() on an event "
                             f"that is already set returns without ever giving the event loop a turn; "
                             f"{RAISE_LIMIT})")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _small_llm(**kwargs):
    from nanoserve import LLM

    return LLM(MODEL, max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=96, **kwargs)


def _loop_error(engine):
    """The exception that ended the engine's step loop, if one did (a stub raises in there, not in the caller)."""
    task = engine.loop_task
    if not task.done() or task.cancelled() or task.exception() is None:
        return None
    error = task.exception()
    while isinstance(error, NotImplementedError) and error.__context__ is not None:
        error = error.__context__  # a stub met while cleaning up (_forget) hides the error that ended the loop
    return error


async def _collect(stream, n: int, stop_after: int | None = None) -> list[list]:
    """The deltas of one request, per completion index; with stop_after, leave (and abort) after that many."""
    got = [[] for _ in range(n)]
    count = 0
    async for delta in stream:
        got[delta.index].append(delta)
        count += 1
        if stop_after is not None and count == stop_after:
            stream.abort()  # what the server does when the client's connection goes away
            break
    return got


async def _bounded(awaitable, what: str, engine, seconds: float = 30):
    """Wait at most `seconds` for `awaitable`: a step loop that never delivers must fail the check, not hang it.
    If the engine's step loop ends first, say why it ended (a learner's exception, or a stub's)."""
    task, seconds = asyncio.ensure_future(awaitable), time_limit(seconds)
    await asyncio.wait({task, engine.loop_task}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    if not task.done() and engine.loop_task.done():
        await asyncio.wait({task}, timeout=1)  # what the loop handed out as it ended comes a moment later
    if task.done():
        return task.result()
    task.cancel()
    if engine.loop_task.done():
        error = _loop_error(engine)
        raise error or AssertionError(f"the step loop returned while {what} was still awaited: it runs until "
                                      f"self.stopping, and fails what it holds when it ends")
    raise AssertionError(f"{what} did not come within {seconds:.0f} s, the check's time limit: does the step loop "
                         f"admit new requests (self._admit) and hand out each step's outputs (self.router)? "
                         f"({RAISE_LIMIT})")


async def _drained(llm, seconds: float = 5) -> bool:
    """Whether the engine has nothing left to run within `seconds` (an abort takes effect before the next step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + time_limit(seconds)
    while llm.engine.has_unfinished() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return not llm.engine.has_unfinished()


def check_step_loop(engine_cls) -> None:
    """Exercise 8.1, the step loop (AsyncEngine.run), against LLM.generate. A request it takes out of the engine
    goes through the package's _forget (exercise 8.2's), so only the loop is checked here."""
    from nanoserve import SamplingParams
    from nanoserve.checks import with_reference
    from nanoserve.serve.async_engine import AsyncEngine

    engine_cls = with_reference(engine_cls, AsyncEngine, "_forget")

    requests = [([11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), True),
                ([5] * 9, SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, ignore_eos=True), True),
                ([7, 8], SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True), False),
                ([40, 41, 42], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), True),
                # 40 tokens in chunks of at most 16: steps that compute it return (seq, None), no token yet
                ([3] * 40, SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True), False)]
    late = ([21, 22, 23], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with _small_llm(max_num_batched_tokens=16, enable_prefix_caching=False) as llm:  # chunks in both runs
        outs = llm.generate([p for p, _, _ in requests] + [late[0]], [s for _, s, _ in requests] + [late[1]],
                            use_tqdm=False)
        metrics = ServerMetrics("check")
        engine_step, threads = llm.engine.step, set()

        def gauge(name):
            return metrics.registry.get_sample_value(f"nanoserve:{name}", {"model_name": "check"})

        def step():  # the engine's step, noting which thread runs it
            threads.add(threading.get_ident())
            return engine_step()

        async def main():
            llm.engine.step = step
            engine = engine_cls(llm, metrics=metrics)
            ENGINES.append(engine)
            loop_thread = threading.get_ident()
            try:
                streams = [await _bounded(engine.add_request(p, s, text), "an added request", engine)
                           for p, s, text in requests]
                got = await _bounded(asyncio.gather(*(_collect(st, s.n) for st, (_, s, _) in zip(streams, requests))),
                                     "every request's tokens", engine)
                left, mapped = len(engine.requests), len(engine.router.owners)
                # a client that leaves: its request is aborted before the next step, long before its 400 tokens
                leaving = await _bounded(engine.add_request([9] * 20, SamplingParams(max_tokens=400, ignore_eos=True)),
                                         "an added request", engine)
                await _bounded(_collect(leaving, 1, stop_after=2), "a leaving request's first tokens", engine)
                aborted = await _drained(llm) and len(leaving.seqs[0].output_ids) < 400
                # idle: the loop sleeps until something comes (it does not spin, asking the engine again and again)
                asks, has_unfinished = [0], llm.engine.has_unfinished
                llm.engine.has_unfinished = lambda: asks.__setitem__(0, asks[0] + 1) or has_unfinished()
                await asyncio.sleep(0.3)
                llm.engine.has_unfinished = has_unfinished
                # a step that raises fails the request in it; the loop goes on, and the next request is served
                runner, collect = llm.engine.runner, llm.engine.runner.collect

                def failing_collect(*args):
                    runner.collect = collect  # once
                    raise RuntimeError("injected by the check")
                runner.collect = failing_collect
                doomed = await _bounded(engine.add_request([9, 9, 9], late[1]), "an added request", engine)
                try:
                    await _bounded(_collect(doomed, 1), "the failed request's end", engine)
                    doomed_error = None
                except Exception as e:  # noqa: BLE001 -- what the failed request ended with
                    doomed_error = e
                runner.collect = collect
                after = await _bounded(engine.add_request(*late), "a request after the failed step", engine)
                after_got = await _bounded(_collect(after, 1), "the tokens of a request after the failed step", engine)
                # stopping with a request in flight: it ends (with an error), it is not left waiting
                last = await _bounded(engine.add_request([6, 6], SamplingParams(max_tokens=400, ignore_eos=True)),
                                      "an added request", engine)
                first_two = [await _bounded(anext(aiter(last)), "a token of the request in flight", engine)
                             for _ in range(2)]
                running = gauge("num_requests_running")  # as the loop saw it at its last turn: 1
                engine.stop()
                try:
                    await _bounded(_collect(last, 1), "the end of a request in flight at stop()", engine, 10)
                    del first_two
                    stopped = None
                except AssertionError:
                    raise
                except Exception as e:  # noqa: BLE001
                    stopped = e
                return (got, left, mapped, aborted, asks[0], loop_thread, doomed_error, after_got, stopped,
                        running)
            except Exception as e:  # a request failed because the step loop died: show why it died
                died = _loop_error(engine)
                if died is not None and "injected by the check" in str(died):
                    raise AssertionError("a step that raised ended the step loop, and every request with it: "
                                         "catch the step's Exception, hand it to self._fail_step, go on") from died
                raise died or e
            finally:
                llm.engine.step = engine_step
                await engine.close()
        server_log = logging.getLogger("nanoserve.serve")
        server_log.disabled = True  # the step the check fails on purpose would print its traceback
        try:
            got, left, mapped, aborted, asks, loop_thread, doomed_error, after_got, stopped, running = _run(main)
        finally:
            server_log.disabled = False
    if loop_thread in threads:
        raise AssertionError("engine.step ran on the event loop's own thread: while it computes, no client can "
                             "connect or read. Run it in the worker thread: loop.run_in_executor(self.executor, ...)")
    for r, ((_, params, text), out, deltas) in enumerate(zip(requests, outs, got)):
        for i, completion in enumerate(out.outputs):
            mine = deltas[i]
            tokens = [d.token_id for d in mine]
            if tokens != list(completion.token_ids):
                raise AssertionError(f"request {r} completion {i}: its stream got tokens {tokens}, LLM.generate "
                                     f"gives {list(completion.token_ids)}: every step's outputs go to "
                                     f"self.router.route, once")
            logprobs = [d.logprobs for d in mine]
            want = completion.logprobs or [None] * len(mine)
            if len(logprobs) != len(want) or not all(
                    (g is None and w is None) or (g is not None and w is not None and set(g) == set(w)
                                                   and all(abs(g[t] - w[t]) < 1e-3 for t in w))
                    for g, w in zip(logprobs, want)):
                raise AssertionError(f"request {r} completion {i}: its deltas' logprobs {logprobs} differ from "
                                     f"LLM.generate's {completion.logprobs}")
            streamed = "".join(d.text for d in mine)
            if text and streamed != completion.text:
                raise AssertionError(f"request {r} completion {i}: streamed text {streamed!r}, want "
                                     f"{completion.text!r}")
    if left or mapped:
        raise AssertionError(f"after every request finished, the engine still holds {left} requests and routes "
                             f"{mapped} sequences")
    if not aborted:
        raise AssertionError("a request whose client left (stream.abort()) was still running in the engine: on "
                             "every turn, before the step, the loop applies the aborts (self._apply_aborts)")
    if asks > 10:
        raise AssertionError(f"with nothing to run, the step loop asked engine.has_unfinished() {asks} times in "
                             f"0.3 s: it spins. Sleep until something happens (self.wake), clearing it first")
    if not isinstance(doomed_error, RuntimeError) or "injected by the check" not in str(doomed_error):
        raise AssertionError(f"a step that raised should fail the request in it (self._fail_step(error)); that "
                             f"request ended with {doomed_error!r}")
    if [d.token_id for d in after_got[0]] != list(outs[-1].outputs[0].token_ids):
        raise AssertionError("after a failed step, the next request did not get LLM.generate's tokens: the loop "
                             "goes on after self._fail_step")
    if stopped is None:
        raise AssertionError("a request in flight at stop() finished all 400 tokens: once self.stopping, the loop "
                             "ends, and every request still held fails (self._fail_all)")
    if running != 1:
        raise AssertionError(f"while one request ran, the gauge of running requests said {running}: report the "
                             f"gauges (self._report) on every turn of the loop")
    left_over = {name: gauge(name) for name in ("num_requests_running", "num_requests_waiting")}
    if any(left_over.values()):
        raise AssertionError(f"after the loop ended, the gauges still show {left_over}: report them "
                             f"(self._report) once more as it ends")
    lengths = [len(c.token_ids) for out in outs[:-1] for c in out.outputs] + [len(outs[-1].outputs[0].token_ids)]

    def sample(name, **labels):
        return metrics.registry.get_sample_value(f"nanoserve:{name}", {"model_name": "check", **labels}) or 0

    generated = sample("generation_tokens_total")
    if generated < sum(lengths):
        raise AssertionError(f"the metrics counted {generated} generated tokens, want at least {sum(lengths)}")
    print(f"✓ step loop: {len(requests)} concurrent requests (one with n=2) each get exactly LLM.generate's tokens, "
          f"steps run off the event loop, an idle loop sleeps, a failed step fails only its "
          f"request, and stop() ends the request in flight")


def check_abort(engine_cls) -> None:
    """Exercise 8.2, _forget, as an abort runs it. The step loop is the package's (exercise 8.1's), so only
    the abort is checked here."""
    from nanoserve import SamplingParams
    from nanoserve.checks import with_reference
    from nanoserve.serve.async_engine import AsyncEngine

    engine_cls = with_reference(engine_cls, AsyncEngine, "run")

    long = SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with _small_llm() as llm:
        want = llm.generate([[3, 4, 5]], [short], use_tqdm=False)[0].outputs[0].token_ids
        pool = llm.engine.cache.block_manager

        async def main():
            engine = engine_cls(llm)
            ENGINES.append(engine)
            try:
                leaving = await _bounded(engine.add_request([9] * 40, long), "an added request", engine)
                staying = await _bounded(engine.add_request([3, 4, 5], short), "an added request", engine)
                left, stayed = await _bounded(asyncio.gather(_collect(leaving, 2, stop_after=3), _collect(staying, 1)),
                                              "the requests' tokens", engine)
                await _drained(llm)  # the abort takes effect before the next step
                if _loop_error(engine) is not None:
                    raise _loop_error(engine)
                ran = max(len(seq.output_ids) for seq in leaving.seqs)  # 400: it was never aborted
                return (left, stayed, engine.engine.has_unfinished() or ran == long.max_tokens, pool.num_free,
                        len(engine.requests), len(engine.router.owners), leaving.finished)
            except Exception as e:  # a request failed because the step loop died: show why it died
                raise _loop_error(engine) or e
            finally:
                await engine.close()
        left, stayed, unfinished, free, held, mapped, finished = _run(main)
    if unfinished:
        raise AssertionError("the engine still runs the aborted request: abort each of its unfinished sequences "
                             "with self.engine.scheduler.abort(seq)")
    if free != pool.num_blocks:
        raise AssertionError(f"{pool.num_blocks - free} of {pool.num_blocks} KV blocks are still held after the "
                             f"abort: scheduler.abort(seq) gives a sequence's blocks back")
    if held:
        raise AssertionError(f"{held} request(s) still in self.requests after the abort: forget the request there")
    if mapped:
        raise AssertionError(f"{mapped} sequence(s) still routed (self.router) after the abort: remove the request's "
                             f"sequences from the router")
    if not finished:
        raise AssertionError("the aborted request's stream is not finished: set its num_unfinished to 0")
    if [d.token_id for d in stayed[0]] != list(want):
        raise AssertionError("the request that stayed did not get LLM.generate's tokens: abort only the "
                             "aborted request's sequences")
    print(f"✓ abort: a client that leaves after {sum(map(len, left))} tokens of a 2 x 400-token request frees all "
          f"{pool.num_blocks} blocks before the next step; the other request gets all its tokens")


def _parse_events(text: str) -> list[str]:
    """The data of each event, as an EventSource parses a stream (HTML standard, "server-sent events")."""
    events, data = [], []
    for line in text.split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


def check_sse(sse) -> None:
    cases = [{"choices": [{"index": 0, "text": "two\nlines"}]}, {"id": "x", "é": "😀"}, "[DONE]"]
    stream = ""
    for case in cases:
        event = sse(case)
        if not isinstance(event, str):
            raise AssertionError(f"sse returns the event as a str, got {type(event).__name__}")
        if not event.startswith("data:") or not event.endswith("\n\n"):  # the space after data: is optional
            raise AssertionError(f"sse({case!r}) = {event!r}: an event is `data: <payload>` and a blank line")
        if event.count("\n") != 2:
            raise AssertionError(f"sse({case!r}) = {event!r}: one data line only (JSON keeps a newline in a "
                                 f"string as \\n)")
        stream += event
    parsed = _parse_events(stream)
    if parsed[-1] != "[DONE]":
        raise AssertionError(f"sse('[DONE]') must send the bare text [DONE], got {parsed[-1]!r}")
    if [json.loads(p) for p in parsed[:-1]] != cases[:-1]:
        raise AssertionError(f"a client parses {parsed[:-1]}; want the dicts back as JSON: {cases[:-1]}")
    print("✓ sse: each dict is one `data:` line of JSON and a blank line; the stream ends with data: [DONE]")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "8.1 step loop": lambda ns: check_step_loop(ns["AsyncEngine"]),
    "8.2 abort": lambda ns: check_abort(ns["AsyncEngine"]),
    "8.3 sse": lambda ns: check_sse(ns["sse"]),
}

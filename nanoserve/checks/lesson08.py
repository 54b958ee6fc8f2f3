"""Checks for lesson 08 (serving), all on a CPU in seconds. Oracles: LLM.generate on the same engine (the
tokens and text each request must get), the block pool's free count (an abort gives every block back), and
the Server-Sent Events format as a client parses it."""
import asyncio
import json
import threading

from nanoserve.serve.metrics import ServerMetrics

MODEL = "tiny-qwen3"


def _run(main):
    """asyncio.run(main()) in a thread of its own: Jupyter's kernel already runs an event loop in this one."""
    result = {}

    def target():
        try:
            result["value"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread below
            result["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
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


def check_deliver(engine_cls) -> None:
    from nanoserve import SamplingParams

    requests = [([11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), True),
                ([5] * 9, SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, ignore_eos=True), True),
                ([7, 8], SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True), False),
                ([40, 41, 42], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), True),
                # 40 tokens in chunks of at most 16: steps that compute it return (seq, None), no token yet
                ([3] * 40, SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True), False)]
    with _small_llm(max_num_batched_tokens=16, enable_prefix_caching=False) as llm:  # chunks in both runs
        outs = llm.generate([p for p, _, _ in requests], [s for _, s, _ in requests], use_tqdm=False)

        metrics = ServerMetrics("check")

        async def main():
            engine = engine_cls(llm, metrics=metrics)
            try:
                streams = [await engine.add_request(p, s, text) for p, s, text in requests]
                got = await asyncio.gather(*(_collect(st, s.n) for st, (_, s, _) in zip(streams, requests)))
                return engine, got, len(engine.requests), len(engine.by_seq)
            except Exception as e:  # a request failed because the step loop died: show why it died
                raise _loop_error(engine) or e
            finally:
                await engine.close()
        engine, got, left, mapped = _run(main)
    for r, ((_, params, text), out, deltas) in enumerate(zip(requests, outs, got)):
        for i, completion in enumerate(out.outputs):
            mine = deltas[i]
            tokens = [d.token_id for d in mine]
            if tokens != list(completion.token_ids):
                raise AssertionError(f"request {r} completion {i}: its stream got tokens {tokens}, LLM.generate "
                                     f"gives {list(completion.token_ids)}. Each output (seq, token) goes to the "
                                     f"queue of the request that owns seq (self.by_seq), with seq.index")
            logprobs = [d.logprobs for d in mine]
            want = completion.logprobs or [None] * len(mine)
            # the same tokens, and values as close as another batch's rounding allows
            if len(logprobs) != len(want) or not all(
                    (g is None and w is None) or (g is not None and w is not None and set(g) == set(w)
                                                   and all(abs(g[t] - w[t]) < 1e-3 for t in w))
                    for g, w in zip(logprobs, want)):
                raise AssertionError(f"request {r} completion {i}: its deltas' logprobs {logprobs} differ from "
                                     f"LLM.generate's {completion.logprobs}: each delta carries its token's step "
                                     f"(seq.logprobs[-1]), or None when the request asked for none")
            reasons = [d.finish_reason for d in mine]
            if reasons[-1] != completion.finish_reason or any(reasons[:-1]):
                raise AssertionError(f"request {r} completion {i}: finish reasons {reasons}; only the last token "
                                     f"carries one ({completion.finish_reason!r}), from seq.finish_reason")
            streamed = "".join(d.text for d in mine)
            if text and streamed != completion.text:
                raise AssertionError(f"request {r} completion {i}: streamed text {streamed!r}, want "
                                     f"{completion.text!r}; with stream_text each delta carries seq.new_text")
            if not text and streamed:
                raise AssertionError(f"request {r}: not streamed, so its deltas carry no text (\"\"), got {streamed!r}")
    if left or mapped:
        raise AssertionError(f"after every request finished, the engine still holds {left} requests and maps "
                             f"{mapped} sequences: a finished completion leaves by_seq, a finished request "
                             f"leaves self.requests")
    lengths = [len(c.token_ids) for out in outs for c in out.outputs]

    def sample(name, **labels):
        return metrics.registry.get_sample_value(f"nanoserve:{name}", {"model_name": "check", **labels}) or 0

    counted = {"generated tokens": (sample("generation_tokens_total"), sum(lengths)),
               "first tokens (TTFT)": (sample("time_to_first_token_seconds_count"), len(requests)),
               "inter-token gaps (ITL)": (sample("inter_token_latency_seconds_count"), sum(n - 1 for n in lengths)),
               "finished requests": (sample("e2e_request_latency_seconds_count"), len(requests)),
               "finished for length": (sample("request_success_total", finished_reason="length"), len(requests))}
    wrong = {what: got for what, (got, want) in counted.items() if got != want}
    if wrong:
        raise AssertionError(f"the metrics counted {wrong}, want {({w: counted[w][1] for w in wrong})}: each token "
                             f"goes through self._time_token, and a finished request through "
                             f"metrics.request_finished (when the engine has metrics)")
    print(f"✓ _deliver: {len(requests)} concurrent requests (one with n=2) each get exactly LLM.generate's tokens, "
          f"text and finish reasons, leave nothing behind, and are counted in the metrics")


def check_abort(engine_cls) -> None:
    from nanoserve import SamplingParams

    long = SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with _small_llm() as llm:
        want = llm.generate([[3, 4, 5]], [short], use_tqdm=False)[0].outputs[0].token_ids
        pool = llm.engine.cache.block_manager

        async def main():
            engine = engine_cls(llm)
            try:
                leaving = await engine.add_request([9] * 40, long)
                staying = await engine.add_request([3, 4, 5], short)
                left, stayed = await asyncio.gather(_collect(leaving, 2, stop_after=3), _collect(staying, 1))
                for _ in range(100):  # the abort takes effect before the next step
                    if not engine.engine.has_unfinished():
                        break
                    await asyncio.sleep(0.01)
                if _loop_error(engine) is not None:
                    raise _loop_error(engine)
                return (left, stayed, engine.engine.has_unfinished(), pool.num_free, len(engine.requests),
                        len(engine.by_seq), leaving.finished)
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
    if held or mapped or not finished:
        raise AssertionError(f"after the abort the engine still lists {held} requests and {mapped} sequences "
                             f"(stream finished: {finished}): forget the request in self.requests and each seq in "
                             f"self.by_seq, and set its num_unfinished to 0")
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
    "8.1 _deliver": lambda ns: check_deliver(ns["AsyncEngine"]),
    "8.2 abort": lambda ns: check_abort(ns["AsyncEngine"]),
    "8.3 sse": lambda ns: check_sse(ns["sse"]),
}

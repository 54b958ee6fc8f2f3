#!/usr/bin/env python3
"""Ctrl-C at random points, with a stream beside it: a search for shared state a stopped step leaves wrong.

A stream of requests with random features (grammars, penalties, logit_bias, min_p, bans, log-probs, n > 1,
stops) runs on one LLM; after its third item, another call on the same LLM (requests with random features
too) is stopped by a KeyboardInterrupt raised at a random event of the engine's code (a sys.settrace hook), or
at the end of the held_interrupts() block that event is in, as a real Ctrl-C would be.
The stream then runs to its end. Each trial checks that the stream got what it gets undisturbed, that the
other call's requests, run again, give what they gave before, and that the pool is whole.

    python tools/ctrl_c_fuzz.py SEED [--trials 8] [--llm '{"async_scheduling": true}']

It prints one line per problem, and `seed S ok` or `seed S: N problems`; exit status 1 on a problem.
On a CPU, with tiny-qwen3 (nanoserve prepare tiny-qwen3).
"""
import argparse
import json
import random
import signal
import sys

from nanoserve import LLM, SamplingParams, StructuredOutputsParams

WORDS = "the quick brown fox jumps over a lazy dog and then some more text here".split()


def random_params(rng: random.Random, seed: int) -> SamplingParams:
    """A request with up to three random features (only combinations SamplingParams accepts)."""
    f = {}
    picked = rng.sample(["penalties", "bias", "min_p", "bad", "min_tokens", "allowed", "logprobs", "json",
                         "regex", "choice", "n", "stop"], rng.randint(0, 3))
    if "penalties" in picked:
        f.update(repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0, 0.5, -0.5]),
                 frequency_penalty=rng.choice([0, 1.0]))
    if "bias" in picked:
        f["logit_bias"] = {rng.randrange(151000): rng.uniform(-50, 50) for _ in range(rng.randint(1, 30))}
    if "min_p" in picked:
        f["min_p"] = rng.choice([0.05, 0.3, 0.9])
    if "bad" in picked:
        f["bad_words"] = rng.sample(["the", " a", "hello world", "ing", " and the"], 2)
    if "allowed" in picked:
        f["allowed_token_ids"] = rng.sample(range(1000), rng.randint(1, 50))
    if "logprobs" in picked:
        f["logprobs"] = rng.randint(0, 5)
    grammar = {"json": dict(json_object=True), "regex": dict(regex="[a-z]{2,9}( [0-9]+)?"),
               "choice": dict(choice=["yes", "no", "maybe so"])}
    for name in ("json", "regex", "choice"):
        if name in picked and "allowed_token_ids" not in f:
            f["structured_outputs"] = StructuredOutputsParams(**grammar[name])
            break
    if "min_tokens" in picked and "structured_outputs" not in f:
        f["min_tokens"] = 1
    if "n" in picked:
        f["n"] = rng.randint(2, 3)
    if "stop" in picked:
        f["stop"] = ["e"]
    temperature = rng.choice([0.0, 0.7, 1.2])
    return SamplingParams(temperature=temperature, top_k=rng.choice([-1, 0, 5]) if temperature else -1, seed=seed,
                          max_tokens=rng.randint(6, 12), **f)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("seed", type=int)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--llm", default="{}", help="LLM settings, as JSON")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    # Python's own handler, as in a terminal or a notebook (one started in a shell's background has SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM("tiny-qwen3", device="cpu", max_model_len=256, **json.loads(args.llm))
    prompts = lambda: [" ".join(rng.choices(WORDS, k=rng.randint(1, 30))) for _ in range(rng.randint(2, 5))]
    stream_prompts, other_prompts = prompts(), prompts()
    stream_params = [random_params(rng, 1000 + i) for i in range(len(stream_prompts))]
    other_params = [random_params(rng, 2000 + i) for i in range(len(other_prompts))]
    pool = llm.cache.block_manager
    free, events, where = pool.num_free, [0], [None]

    def stop_at(n):
        """Count the engine's events; from the n-th on, raise KeyboardInterrupt at the first one that a real
        SIGINT could reach: not inside held_interrupts(), which holds it (Python's handler is not set there)."""
        armed = [n > 0]

        def tracer(frame, event, arg):
            if "nanoserve" in frame.f_code.co_filename:
                events[0] += 1
                if armed[0] and events[0] >= n and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    armed[0], where[0] = False, f"{frame.f_code.co_qualname}, line {frame.f_lineno}"
                    raise KeyboardInterrupt
            return tracer
        return tracer

    def other_call():
        return [[c.token_ids for c in o.outputs] for o in llm.generate(other_prompts, other_params, use_tqdm=False)]

    def trial(point):
        stream, got = llm.stream(stream_prompts, stream_params), {}
        for n, item in enumerate(stream):
            got.setdefault((item[0], item.completion), []).append((item[2], item[1]))
            if n == 2:
                events[0] = 0
                sys.settrace(stop_at(point))
                try:
                    other_call()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
        return got

    clean_stream = trial(-1)
    total, clean_other, problems = events[0], other_call(), 0
    for _ in range(args.trials):
        point = rng.randrange(1, total)
        if trial(point) != clean_stream:
            problems += 1
            print(f"seed {args.seed}, stopped at event {point} of {total} ({where[0]}): the stream beside changed")
        if other_call() != clean_other:
            problems += 1
            print(f"seed {args.seed}, stopped at event {point} of {total} ({where[0]}): the stopped call's requests, run again, "
                  "changed")
        if pool.num_free != free or llm.engine.has_unfinished():
            problems += 1
            print(f"seed {args.seed}, stopped at event {point} of {total} ({where[0]}): the pool is not whole "
                  f"({pool.num_free} of {free} free)")
    print(f"seed {args.seed} ok" if not problems else f"seed {args.seed}: {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

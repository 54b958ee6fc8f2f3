#!/usr/bin/env python3
"""How fast llguidance fills one step's grammar masks on this machine's CPU, and from which matchers.

256 rows of the regex `[a-z ]{1,2000}` (the engine's slices for it), each advanced by a token between fills
(a fill in a state already seen is cached, so each timed fill meets new states), with 1, 4 and the engine's
MASK_THREADS of llguidance's threads. The rows follow:
  * one base: copies of one compiled matcher (copies of one wait for each other);
  * interleaved: copies of the engine's MASK_THREADS compiled matchers, handed out in turn (the engine's way);
  * grouped: the same copies, listed in runs of one compiled matcher;
  * own: a separately compiled matcher per row.

    python bench/llguidance_parallel.py [--model tiny-qwen3]      (prints ms per step)
"""
import argparse
import random
import time

import llguidance
import torch
from transformers import AutoTokenizer

from nanoserve.engine.sampling_params import StructuredOutputsParams
from nanoserve.features import structured_outputs as so
from nanoserve.model.zoo import resolve_model

ROWS, STEPS = 256, 20


def fill_ms(executor, matchers, order, words, width) -> float:
    """Mean ms of one step's fill, every row advanced by a random word before each."""
    buf = torch.empty(ROWS, width, dtype=torch.int32)
    rng, total = random.Random(0), 0.0
    for _ in range(STEPS):
        for m in matchers:
            m.consume_token(rng.choice(words))
        start = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(matchers[r], r) for r in order], buf.data_ptr(), width * 4, ROWS)
        total += time.perf_counter() - start
    return total / STEPS * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(resolve_model(ap.parse_args().model))
    grammar = so.compiled_grammar(tok, StructuredOutputsParams(regex="[a-z ]{1,2000}"))  # (the others compile now)
    deadline = time.monotonic() + 60
    while len(grammar.bases) < so.MASK_THREADS and time.monotonic() < deadline:
        time.sleep(0.01)
    bases, width = grammar.bases, (grammar.ll.vocab_size + 31) // 32
    words = [tok.encode(w)[0] for w in (" abc", " the", " hello", " x", "abc", " zebra", " q")]
    print(f"{ROWS} rows, {len(bases)} compiled matchers (MASK_THREADS {so.MASK_THREADS}); ms per step's fill")
    for threads in sorted({1, 4, so.MASK_THREADS}):
        executor = llguidance.LLExecutor(num_threads=threads)
        rows = {
            "one base": ([bases[0].deep_copy() for _ in range(ROWS)], range(ROWS)),
            "interleaved": ([bases[r % len(bases)].deep_copy() for r in range(ROWS)], range(ROWS)),
            "grouped": ([bases[r % len(bases)].deep_copy() for r in range(ROWS)],
                        sorted(range(ROWS), key=lambda r: r % len(bases))),
            "own": ([llguidance.LLMatcher(grammar.ll, grammar.grammar, log_level=0) for _ in range(ROWS)],
                    range(ROWS)),
        }
        print(f"{threads:2d} threads:", ", ".join(f"{name} {fill_ms(executor, ms, list(order), words, width):.2f}"
                                               for name, (ms, order) in rows.items()))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# python bench/llguidance_parallel.py: mask fill time per step, 16 rows of a regex in distinct states, 1 and 2
# threads; llguidance's default slices (copies, own matchers) against the engine's (the regex's own slices).
"""Does LLExecutor fill masks in parallel for deep copies of one compiled matcher, or only for separately
compiled ones? 2 threads vs 1, rows in distinct states."""
import time, torch, llguidance, random
from transformers import AutoTokenizer
from nanoserve.model.zoo import resolve_model
from nanoserve.engine.sampling_params import StructuredOutputsParams
from nanoserve.features.structured_outputs import compiled_grammar, ll_tokenizer, compile_checked
tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen3"))
spec = StructuredOutputsParams(regex="[a-z ]{1,2000}")
ll = ll_tokenizer(tok)
width = (ll.vocab_size + 31) // 32
letters = [t for t in range(ll.vocab_size) if (s := tok.decode([t])) and all(c in "abcdefghijklmnopqrstuvwxyz " for c in s)][:3000]
R = 16
def run(make, threads):
    ms = [make() for _ in range(R)]
    rng = random.Random(0)
    for m in ms:  # distinct states
        for _ in range(rng.randint(1, 30)):
            m.consume_token(rng.choice(letters))
    ex = llguidance.LLExecutor(num_threads=threads)
    buf = torch.empty(R, width, dtype=torch.int32)
    total = 0
    for step in range(10):
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, r) for r, m in enumerate(ms)], buf.data_ptr(), width * 4, R)
        total += time.perf_counter() - t
        for m in ms:
            m.consume_token(rng.choice(letters))
    return total / 10 * 1e3
base = compile_checked(ll, spec)[1]
copies = base.deep_copy
own = lambda: llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(spec.regex), log_level=0)
engine = compiled_grammar(tok, spec).matcher  # the engine's: copies of MASK_THREADS compiled ones, the regex's slices
for name, make in (("deep copies", copies), ("own matchers", own), ("the engine's", engine)):
    print(name, {n: f"{run(make, n):.1f} ms/step" for n in (1, 2)})

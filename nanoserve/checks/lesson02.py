"""Checks for lesson 02 (the KV cache). Oracles: torch SDPA, and lesson 01's naive forward."""
import torch
from torch.nn import functional as F

from nanoserve.checks.lesson01 import TINY_CONFIGS, _close, hf_tiny_model, ours_from_hf


def check_store_kv(store_kv) -> None:
    gen = torch.Generator().manual_seed(10)
    k_cache, v_cache = torch.zeros(3, 10, 2, 4), torch.zeros(3, 10, 2, 4)
    rows, positions = torch.tensor([0, 0, 0, 2, 1]), torch.tensor([4, 5, 6, 0, 9])
    k, v = torch.randn(5, 2, 4, generator=gen), torch.randn(5, 2, 4, generator=gen)
    store_kv(k_cache, v_cache, rows, positions, k, v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for i in range(5):
        want_k[rows[i], positions[i]], want_v[rows[i], positions[i]] = k[i], v[i]
    _close("k_cache after store_kv", k_cache, want_k, 0, "Token i goes to [rows[i], positions[i]]; touch nothing else.")
    _close("v_cache after store_kv", v_cache, want_v, 0, "Store v as well as k.")
    print("✓ store_kv writes each token to its (row, position) and nowhere else")


def check_decode_attention(decode_attention) -> None:
    gen = torch.Generator().manual_seed(11)
    for H, Hkv, D in [(2, 2, 64), (4, 2, 128), (8, 2, 64), (6, 2, 64)]:
        lengths = torch.tensor([1, 7, 3, 12])
        B, L = len(lengths), int(lengths.max())
        q = torch.randn(B, H, D, generator=gen)
        # Slots past each row's length hold garbage: a missing mask shows up at once.
        k_cache = torch.randn(B, L, Hkv, D, generator=gen) * 10
        v_cache = torch.randn(B, L, Hkv, D, generator=gen) * 10
        want = torch.stack([
            F.scaled_dot_product_attention(
                q[b][:, None], k_cache[b, :n].repeat_interleave(H // Hkv, 1).transpose(0, 1),
                v_cache[b, :n].repeat_interleave(H // Hkv, 1).transpose(0, 1))[:, 0]
            for b, n in enumerate(lengths.tolist())])
        _close(f"decode_attention(heads={H}, kv_heads={Hkv}, head_dim={D}, lengths={lengths.tolist()})",
               decode_attention(q, k_cache, v_cache, lengths), want, 1e-4,
               "Row b may only see slots 0..lengths[b]-1; query head h uses kv head h // group.")
    print("✓ decode_attention matches torch SDPA over each row's filled slots")


def check_generate(generate) -> None:
    from nanoserve.cache.metadata import StepMetadataBuilder
    from nanoserve.checks import first_difference
    from nanoserve.course.contiguous import ContiguousKVCache
    from nanoserve.course.naive import naive_generate
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.model.qwen3 import Qwen3ForCausalLM

    prompts = [[5, 9, 2], [7], [11, 3, 8, 8, 1, 40, 2, 9], [4, 4], [100, 200, 300, 17, 9]]
    max_tokens = [12, 9, 4, 12, 1]
    held = [2, 0, 5, 1, 3]  # leading prompt tokens a cache already holds (as lesson 04's prefix cache reports)

    class HoldsPrefixes(ContiguousKVCache):
        """A contiguous cache whose rows already hold the K/V of each prompt's first held[i] tokens."""

        def reserve(self, seq_id, prompt_ids, reuse=True):
            super().reserve(seq_id, prompt_ids, reuse)
            return held[seq_id] if reuse else 0

    for name in ["qwen3 group=2 head_dim=128", "llama group=2 head_dim=64"]:
        # An untied LM head: a tied one makes tiny random models repeat their last token, and
        # repetitive output would hide a wrong position or a stale cache slot.
        model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS[name], seed=12, tie=False))
        want = [naive_generate(model, p, m) for p, m in zip(prompts, max_tokens)]
        params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
        alone = [generate(model, [p], [sp])[0][0].token_ids for p, sp in zip(prompts, params)]
        completions, cache = generate(model, prompts, params)
        for i, w in enumerate(want):
            if alone[i] != w:
                raise AssertionError(f"{name}: prompt {i} alone: {first_difference(alone[i], w, 'token')} (want: "
                                     f"the naive forward's)")
            if completions[i].token_ids != w:
                raise AssertionError(f"{name}: prompt {i} in a batch: "
                                     f"{first_difference(completions[i].token_ids, w, 'token')} (want: the naive "
                                     f"forward's). Check positions and cache rows of each request.")
        running = [sum(1 for m in max_tokens if m > step) for step in range(1, max(max_tokens))]
        expected = [sum(map(len, prompts))] + running
        if list(cache.tokens_per_forward) != expected:
            counts = list(cache.tokens_per_forward)
            raise AssertionError(f"tokens per forward: {first_difference(counts, expected, 'forward')}: the prompts "
                                 f"once, then one token per unfinished request")
        if [c.finish_reason for c in completions] != ["length"] * len(prompts):
            raise AssertionError(f"finish reasons {[c.finish_reason for c in completions]}, expected 'length'")
        # The cache reports the first tokens of some prompts as cached, and holds their K/V (computed here by
        # the model): the prefill computes only the rest of each prompt, and the tokens stay the same.
        cache = HoldsPrefixes(model.config, len(prompts), 16)
        meta = StepMetadataBuilder(sum(held), len(prompts), 1).build(
            cache, [(i, 0, p[:n]) for i, (p, n) in enumerate(zip(prompts, held)) if n])
        with torch.inference_mode():
            model(meta.input_ids, meta.positions, cache, meta)
        cache.tokens_per_forward.clear()
        completions, cache = generate(model, prompts, params, cache=cache)
        computed, uncached = (list(cache.tokens_per_forward) or [0])[0], sum(len(p) - n for p, n in zip(prompts, held))
        if computed != uncached:
            raise AssertionError(f"the prefill computed {computed} tokens, want {uncached}: cache.reserve reported "
                                 f"the first {held} tokens of the prompts as cached; feed each from cached[i] on")
        for i, w in enumerate(want):
            if completions[i].token_ids != w:
                raise AssertionError(f"{name}: prompt {i} with its first {held[i]} tokens cached: "
                                     f"{first_difference(completions[i].token_ids, w, 'token')} (want: the naive "
                                     f"forward's). Its new tokens start at position cached[i]")
    print("✓ greedy tokens with the cache equal the naive forward's (alone and batched); "
          "each forward carried the prompts once, then 1 token per running request")


def check_unpack_bitmask(unpack_bitmask) -> None:
    """Against llguidance's own masking (which sets the logits of forbidden tokens to -inf), on random words
    and the edge cases the hint names: all ones, only the sign bit, a vocabulary that is not a multiple of 32,
    one larger than the mask, a single row."""
    import llguidance.torch

    gen = torch.Generator().manual_seed(24)
    cases = [(1, 1, 32), (1, 1, 20), (2, 3, 96), (3, 2, 70), (4, 5, 150), (1, 4, 200), (5, 7, 224)]
    for case, (rows, words, vocab) in enumerate(cases * 3):
        bitmask = torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)
        if case % 3 == 1:
            bitmask[0, 0] = -1  # all 32 bits
        if case % 3 == 2:
            bitmask[-1, -1] = -2**31  # only bit 31
        got = unpack_bitmask(bitmask.clone(), vocab)
        if not isinstance(got, torch.Tensor) or got.shape != (rows, vocab) or got.dtype != torch.bool:
            raise AssertionError(f"unpack_bitmask({rows}x{words} words, vocab_size={vocab}) should return a "
                                 f"[{rows}, {vocab}] bool tensor, got {getattr(got, 'shape', type(got))} "
                                 f"{getattr(got, 'dtype', '')}")
        logits = torch.zeros(rows, vocab)
        covered = min(vocab, 32 * words)
        llguidance.torch.apply_token_bitmask_inplace(logits[:, :covered], bitmask)
        want = logits == 0
        want[:, covered:] = False  # no bit: never allowed
        if not torch.equal(got, want):
            r, t = (got != want).nonzero()[0].tolist()
            raise AssertionError(f"unpack_bitmask({rows}x{words} words, vocab_size={vocab}): token {t} of row {r} "
                                 f"should be {'allowed' if want[r, t] else 'forbidden'} (word {t // 32}, bit {t % 32}"
                                 f"{', past the words: forbidden' if t >= 32 * words else ''}). Bit j of word w is "
                                 f"token 32 * w + j, the lowest bit first.")
    print("✓ unpack_bitmask matches llguidance's masking (signs, padding, a vocabulary beyond the mask)")


def check_penalties(Penalties) -> None:
    """One processor over many steps, against the formula (transformers' RepetitionPenaltyLogitsProcessor over
    the prompt and the output, then minus frequency x count and presence x drawn): rows join, leave and move
    to other slots; a small vocabulary, so tokens are drawn many times and are often in the prompt too;
    penalties below 1 and negative; banned (-inf) logits; rows of the step that use no penalty; a drawn token
    still on the device (async scheduling); and draws that are never processed (an error, Ctrl-C)."""
    import math
    import random
    from types import SimpleNamespace

    from transformers import RepetitionPenaltyLogitsProcessor

    from nanoserve.features.processors import Rows
    from nanoserve.engine.sampling_params import SamplingParams

    rng = random.Random(25)
    for case in range(8):
        vocab, max_rows = rng.choice([6, 11, 40]), rng.randint(1, 6)
        penalties = Penalties(max_rows, vocab, torch.device("cpu"))
        live, free, waiting = {}, list(range(max_rows)), []  # slot -> sequence; sequences not running
        for step in range(24):
            for slot in [s for s in live if rng.random() < 0.15]:  # leave (some come back later, elsewhere)
                waiting.append(live.pop(slot))
                free.append(slot)
            while free and (not live or rng.random() < 0.4):  # join, at any free slot
                slot = free.pop(rng.randrange(len(free)))
                if waiting and rng.random() < 0.5:
                    seq = waiting.pop(rng.randrange(len(waiting)))
                    if seq.pending is not None:  # its token in flight was processed before it left
                        seq.output_ids.append(seq.pending)
                        seq.pending = None
                else:
                    p = SamplingParams(repetition_penalty=rng.choice([1.0, 0.6, 1.5, 2.0]),
                                       frequency_penalty=rng.choice([0.0, -1.0, 0.5, 2.0]),
                                       presence_penalty=rng.choice([0.0, 1.5, -0.5]))
                    seq = SimpleNamespace(params=p, prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 6))],
                                          output_ids=[rng.randrange(vocab) for _ in range(rng.randint(0, 4))],
                                          pending=None)
                penalties.add(slot, seq)
                live[slot] = seq
            order = rng.sample(sorted(live), len(live))  # rows move between steps
            size = len(order) + rng.randint(0, 2)  # the step's other rows use no penalty
            index = rng.sample(range(size), len(order))
            seqs = [live[s] for s in order]
            logits = torch.randn(size, vocab) * 3
            logits[torch.rand(size, vocab) < 0.15] = -math.inf  # banned by an earlier processor
            raw = logits.clone()
            last_inputs = torch.zeros(size, dtype=torch.long)
            for i, seq in zip(index, seqs):
                last_inputs[i] = seq.pending if seq.pending is not None else 0
            rows = Rows(torch.tensor(index), torch.tensor(order), list(order), seqs,
                        [len(s.output_ids) + (s.pending is not None) for s in seqs], lambda: last_inputs)
            penalties.apply(logits, rows)
            want = raw.clone()
            for i, seq in zip(index, seqs):
                p, output = seq.params, seq.output_ids + ([seq.pending] if seq.pending is not None else [])
                ids = torch.tensor([seq.prompt_ids + output])
                row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, raw[i:i + 1].clone())[0]
                counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
                want[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            finite = torch.isfinite(want)
            bad = (torch.isfinite(logits) != finite) | (finite & ((logits - want).abs() > 1e-4))
            if bad.any():
                r, t = bad.nonzero()[0].tolist()
                seq = seqs[index.index(r)] if r in index else None
                where = ("a row that uses no penalty: leave it as it is" if seq is None else
                         f"prompt {seq.prompt_ids}, drawn {seq.output_ids}"
                         f"{f' and {seq.pending} (still on the device)' if seq.pending is not None else ''}, "
                         f"{seq.params.repetition_penalty=}, {seq.params.frequency_penalty=}, "
                         f"{seq.params.presence_penalty=}")
                raise AssertionError(f"step {step}: row {r}, token {t}: logit {raw[r, t].item():.4f} became "
                                     f"{logits[r, t].item():.4f}, expected {want[r, t].item():.4f} ({where})")
            tokens = torch.randint(0, vocab, (size,), generator=torch.Generator().manual_seed(case * 100 + step))
            penalties.drawn(rows, tokens)
            for i, seq in zip(index, seqs):
                if seq.pending is not None:  # the step before is processed now
                    seq.output_ids.append(seq.pending)
                    seq.pending = None
                fate = rng.random()
                if fate < 0.6:
                    seq.output_ids.append(int(tokens[i]))  # processed
                elif fate < 0.85:
                    seq.pending = int(tokens[i])  # on the device only, until the next step is processed
                # else: never processed (the step failed): the processor must not count it
    print("✓ Penalties match the formula step after step (repeats, joins and moves, -inf, lost and pending draws)")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "2.1 store_kv": lambda ns: check_store_kv(ns["store_kv"]),
    "2.2 decode_attention": lambda ns: check_decode_attention(ns["decode_attention"]),
    "2.3 generate": lambda ns: check_generate(ns["generate"]),
    "2.4 unpack_bitmask": lambda ns: check_unpack_bitmask(ns["unpack_bitmask"]),
    "2.5 penalties": lambda ns: check_penalties(ns["Penalties"]),
}

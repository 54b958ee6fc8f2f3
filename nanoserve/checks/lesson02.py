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
    from nanoserve.model.qwen3 import Qwen3ForCausalLM
    from nanoserve.course.naive import naive_generate
    from nanoserve.engine.sampling_params import SamplingParams

    prompts = [[5, 9, 2], [7], [11, 3, 8, 8, 1, 40, 2, 9], [4, 4], [100, 200, 300, 17, 9]]
    max_tokens = [12, 9, 4, 12, 1]
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
                raise AssertionError(f"{name}: prompt {i} alone gives {alone[i]}, the naive forward {w}")
            if completions[i].token_ids != w:
                raise AssertionError(f"{name}: prompt {i} in a batch gives {completions[i].token_ids}, the naive "
                                     f"forward {w}. Check positions and cache rows of each request.")
        running = [sum(1 for m in max_tokens if m > step) for step in range(1, max(max_tokens))]
        expected = [sum(map(len, prompts))] + running
        if list(cache.tokens_per_forward) != expected:
            raise AssertionError(f"tokens per forward {list(cache.tokens_per_forward)}, expected {expected}: the prompts "
                                 f"once, then one token per unfinished request")
        if [c.finish_reason for c in completions] != ["length"] * len(prompts):
            raise AssertionError(f"finish reasons {[c.finish_reason for c in completions]}, expected 'length'")
    print("✓ greedy tokens with the cache equal the naive forward's (alone and batched); "
          "each forward carried the prompts once, then 1 token per running request")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
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


EXERCISES = {
    "2.1 store_kv": lambda ns: check_store_kv(ns["store_kv"]),
    "2.2 decode_attention": lambda ns: check_decode_attention(ns["decode_attention"]),
    "2.3 generate": lambda ns: check_generate(ns["generate"]),
    "2.4 unpack_bitmask": lambda ns: check_unpack_bitmask(ns["unpack_bitmask"]),
}

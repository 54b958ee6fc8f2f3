"""Lesson 02: the KV cache (its exercise checks: test_exercises.py), the sampler, SamplingParams, stop strings."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nanoserve.engine.detokenizer import Detokenizer
from nanoserve.course.generate import generate
from nanoserve.model.loader import load_model
from nanoserve.engine.sampler import sample
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.zoo import resolve_model


# --- the sampler -------------------------------------------------------------------------------------

def draw(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n samples from one row of logits: the same row n times, at steps 0..n-1."""
    return sample(logits.expand(n, -1), torch.full((n,), float(temperature)), torch.full((n,), top_k),
                  torch.full((n,), float(top_p)), torch.full((n,), seed), torch.arange(n))


def allowed_probs(logits, temperature, top_k, top_p):
    """Reference: the distribution after top-k then top-p, written the slow, obvious way."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    kept_mass = sum(probs[i] for i in keep)
    chosen, mass = [], 0.0
    for i in keep:
        chosen.append(i)
        mass += probs[i] / kept_mass
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen]
    return out / out.sum()


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(2, 40), top_k=st.integers(0, 10), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.3, 3.0), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_top_k_top_p_never_sample_outside_the_allowed_set(vocab, top_k, top_p, temperature, seed, data):
    # Distinct logits (at least 0.1 apart): with ties, either tied token may rightly be kept.
    tenths = data.draw(st.lists(st.integers(-50, 50), min_size=vocab, max_size=vocab, unique=True))
    logits = torch.tensor(tenths, dtype=torch.float32) / 10
    # The sampler adds up probabilities in float32; allow for its rounding at the top-p boundary.
    allowed = allowed_probs(logits, temperature, top_k, min(1.0, top_p + 1e-5)) > 0
    tokens = draw(logits, 300, temperature, top_k, top_p, seed)
    assert allowed[tokens].all(), f"sampled {sorted(set(tokens.tolist()) - set(allowed.nonzero().flatten().tolist()))}"


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.8), (5, 0.9)])
def test_empirical_distribution_matches_the_softmax(top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 40_000
    freq = torch.bincount(draw(logits, n, 1.0, top_k, top_p, seed=7), minlength=8).double() / n
    want = allowed_probs(logits, 1.0, top_k, top_p)
    total_variation = 0.5 * (freq - want).abs().sum().item()
    assert total_variation < 0.015, (freq, want)  # expected ~0.005 for 40k draws over 8 tokens


def test_temperature_towards_zero_is_greedy():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    n = logits.shape[0]
    near_zero = sample(logits, torch.full((n,), 1e-4), torch.zeros(n, dtype=torch.long), torch.ones(n),
                       torch.arange(n), torch.zeros(n, dtype=torch.long))
    zero = sample(logits, torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                  torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert torch.equal(near_zero, logits.argmax(-1)) and torch.equal(zero, logits.argmax(-1))


def test_a_seeded_row_samples_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(500, generator=gen)
    tokens = []
    for batch_size, where in [(1, 0), (5, 3), (9, 8)]:
        logits = torch.randn(batch_size, 500, generator=gen)
        logits[where] = row
        temperature = torch.rand(batch_size, generator=gen) + 0.5
        temperature[where] = 1.0
        seeds = torch.randint(0, 2**62, (batch_size,), generator=gen)
        seeds[where] = 99
        steps = torch.randint(0, 100, (batch_size,), generator=gen)
        steps[where] = 17
        out = sample(logits, temperature, torch.zeros(batch_size, dtype=torch.long), torch.ones(batch_size), seeds, steps)
        tokens.append(int(out[where]))
    assert len(set(tokens)) == 1, tokens


def test_different_seeds_and_steps_give_different_draws():
    logits = torch.zeros(1000)  # uniform: every draw equally likely
    by_step = draw(logits, 200, seed=5)
    other_seed = draw(logits, 200, seed=6)
    assert len(set(by_step.tolist())) > 150 and (by_step != other_seed).float().mean() > 0.9


# --- SamplingParams ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.1), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed="x"), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must"):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_vllm_spellings():
    sp = SamplingParams(top_k=-1, stop="###")
    assert sp.top_k == 0 and sp.stop == ["###"]


# --- stop strings and the generate loop -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny-qwen3")
    return load_model(path, device="cpu"), AutoTokenizer.from_pretrained(path)


def test_stop_string_spanning_tokens(tiny):
    _, tok = tiny
    ids = tok.encode("Roses are red.\n\nViolets are blue.")
    for stop, want in [(["red.\n\nV"], "Roses are "), (["blue", "s are"], "Rose"), (["Roses"], ""), (["zzz"], None)]:
        detok = Detokenizer(tok, stop)
        for t in ids:
            detok.add(t)
            if detok.stopped:
                break
        assert detok.text == (want if want is not None else tok.decode(ids)), stop
        assert detok.stopped == (want is not None)


def test_generate_stops_at_a_stop_string_and_on_stop_tokens(tiny):
    model, tok = tiny
    prompt = tok.encode("Once upon a time")
    free, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), tokenizer=tok)
    text, ids = free[0].text, free[0].token_ids
    # A stop string made of the end of token 3 and the start of token 5 of the free run.
    start = len(tok.decode(ids[:3])) - 2
    stop = text[start:len(tok.decode(ids[:5])) + 1]
    assert len(stop) > 2, (text, stop)
    stopped, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True),
                          tokenizer=tok)
    assert stopped[0].finish_reason == "stop" and stopped[0].text == text[:text.index(stop)]
    assert len(stopped[0].token_ids) < 12
    by_id, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[4]]))
    assert by_id[0].token_ids == ids[:ids.index(ids[4]) + 1] and by_id[0].finish_reason == "stop"


def test_eos_ends_unless_ignored(tiny):
    model, tok = tiny
    prompt = tok.encode("Hello there")
    free, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=6))
    eos = free[0].token_ids[2]  # pretend the third token is end-of-sequence
    ended, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=6), eos_token_ids=[eos])
    ignored, _ = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          eos_token_ids=[eos])
    assert ended[0].token_ids == free[0].token_ids[:free[0].token_ids.index(eos) + 1]
    assert ignored[0].token_ids == free[0].token_ids and ignored[0].finish_reason == "length"


def test_empty_prompt_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        generate(tiny[0], [[1, 2], []])


def test_streamed_text_never_includes_a_stop_string(tiny):
    _, tok = tiny
    ids = tok.encode("Roses are red.\n\nViolets are blue.")
    for stop in (["red.\n\nV"], ["blue"], []):
        detok, streamed = Detokenizer(tok, stop), ""
        for t in ids:
            streamed += detok.add(t)
            if detok.stopped:
                break
        streamed += detok.flush()
        assert streamed == detok.text
        assert not any(s in streamed for s in stop)


def test_huge_and_negative_seeds_are_accepted(tiny):
    model, _ = tiny
    for seed in (2**70, -5):
        out, _ = generate(model, [[1, 2, 3]], SamplingParams(temperature=1.0, seed=seed, max_tokens=3))
        again, _ = generate(model, [[1, 2, 3]], SamplingParams(temperature=1.0, seed=seed, max_tokens=3))
        assert out[0].token_ids == again[0].token_ids


def test_bad_generate_calls_fail_clearly_and_free_what_they_took(tiny):
    from nanoserve.cache.paged import PagedKVCache

    model, _ = tiny
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [])
    with pytest.raises(ValueError, match="stop strings and bad_words need the tokenizer"):
        generate(model, [[1, 2]], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="exceeds the model's 4096 positions"):
        generate(model, [[1, 2]], SamplingParams(max_tokens=5000))
    cache = PagedKVCache(model.config, num_blocks=3, block_size=4)  # room for the first prompt only
    with pytest.raises(RuntimeError, match="blocks"):
        generate(model, [[1] * 8, [2] * 8], SamplingParams(max_tokens=2), cache=cache)
    assert cache.block_manager.num_free == 3  # the first prompt's blocks were given back

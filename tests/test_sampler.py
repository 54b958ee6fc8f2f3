"""The sampler keeps its promises: a filtered-out token is never chosen, top_k=1 is the argmax, and a
request's tokens do not depend on its batch-mates' parameters -- in lesson 02's sampler and lesson 06's."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanoserve.engine.fused_sampler import FusedSampler
from nanoserve.engine.sampler import Sampler, hash_uniform, sample
from nanoserve.engine.sampling_params import SamplingParams

QWEN3_VOCAB = 151936
# (seed, step, token) where a hash keeping 24 bits would give u == 1.0 exactly, and -log(u) = 0.
ROUNDED_TO_ONE = (11, 3, 138113)


def rows(n, value, dtype=None):
    return torch.full((n,), value, dtype=dtype)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), step=st.integers(0, 2**31))
@example(seed=ROUNDED_TO_ONE[0], step=ROUNDED_TO_ONE[1])
def test_uniforms_are_strictly_inside_0_1(seed, step):
    u = hash_uniform(torch.tensor([seed]), torch.tensor([step]), QWEN3_VOCAB)
    assert 0 < u.min() and u.max() < 1
    assert (-torch.log(u)).min() > 0  # the race's E: never 0, so no 0/0 and no infinite winner


def python_uniform(seed: int, step: int, token: int) -> float:
    """hash_uniform's number written with Python's unbounded ints and explicit 32-bit masks: the definition
    that the int32 tensor code (wrapping products, masked shifts) must reproduce bit for bit."""
    def mix(x):
        x ^= x >> 16
        x = x * 0x7FEB352D & 0xFFFFFFFF
        x ^= x >> 15
        x = x * 0x2C1B3C6D & 0xFFFFFFFF
        return x ^ x >> 16
    s = mix(seed & 0xFFFFFFFF) ^ mix(seed >> 32 & 0xFFFFFFFF)
    s = mix((s + mix(step & 0xFFFFFFFF)) & 0xFFFFFFFF)
    bits = mix((s * 0x5BD1E995 + token) & 0xFFFFFFFF)
    return ((bits >> 9) + 0.5) / 2**23


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), step=st.integers(0, 2**40), vocab=st.integers(1, 3000))
@example(seed=ROUNDED_TO_ONE[0], step=ROUNDED_TO_ONE[1], vocab=QWEN3_VOCAB)
def test_uniforms_are_the_hash_of_seed_step_and_token(seed, step, vocab):
    u = hash_uniform(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
    tokens = sorted({0, vocab - 1, vocab // 2, vocab // 3})
    assert [u[t].item() for t in tokens] == [python_uniform(seed, step, t) for t in tokens]


def logits_with_ties(data, vocab, batch):
    """Logits on a coarse grid (many exact ties), or near-uniform ones (a long tail), per the draw."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        return torch.randint(-8, 8, (batch, vocab), generator=gen).float() / 4
    return torch.randn(batch, vocab, generator=gen) * data.draw(st.sampled_from([0.01, 0.5, 3.0]))


def draw_case(data, vocab, batch, seed, issue_scale):
    """(logits, seeds, steps): the issue's draw when data is None (one row at seed 11, step 3, where token
    138113's u was 1: it must lose like any other), else a batch from hypothesis."""
    if data is None:
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * issue_scale
        steps = torch.tensor([ROUNDED_TO_ONE[1]])
    else:
        logits = logits_with_ties(data, vocab, batch)
        steps = torch.tensor(data.draw(st.lists(st.integers(0, 1000), min_size=batch, max_size=batch)))
    return logits, torch.arange(logits.shape[0]) + seed % 2**62, steps


@settings(max_examples=25, deadline=None)
@given(vocab=st.sampled_from([2, 3, 17, 1000, QWEN3_VOCAB]), temperature=st.floats(0.05, 5.0),
       seed=st.integers(0, 2**63 - 1), data=st.data())
@example(vocab=QWEN3_VOCAB, temperature=1.0, seed=ROUNDED_TO_ONE[0], data=None)
def test_top_k_1_is_the_argmax(vocab, temperature, seed, data):
    logits, seeds, steps = draw_case(data, vocab, 8, seed, issue_scale=1.0)
    n = logits.shape[0]
    got = sample(logits, rows(n, temperature), rows(n, 1), rows(n, 1.0), seeds, steps)
    assert torch.equal(got, logits.argmax(dim=-1))


def nucleus(logits, temperature, top_k, top_p):
    """Reference, in float64: the tokens top-k and top-p may keep (with slack for float32 at the boundary)."""
    order = logits.double().argsort(descending=True, stable=True)
    keep = order[:top_k] if top_k else order
    probs = (logits.double()[keep] / temperature).softmax(-1)
    before = probs.cumsum(-1) - probs
    return set(keep[before < top_p + 1e-4].tolist())


@settings(max_examples=25, deadline=None)
@given(vocab=st.sampled_from([5, 300, QWEN3_VOCAB]), top_k=st.integers(0, 50), top_p=st.floats(0.01, 1.0),
       temperature=st.floats(0.2, 3.0), seed=st.integers(0, 2**63 - 1), data=st.data())
@example(vocab=QWEN3_VOCAB, top_k=0, top_p=0.5, temperature=1.0, seed=ROUNDED_TO_ONE[0], data=None)
def test_a_filtered_token_is_never_chosen(vocab, top_k, top_p, temperature, seed, data):
    logits, seeds, steps = draw_case(data, vocab, 4, seed, issue_scale=3.0)
    n = logits.shape[0]
    got = sample(logits, rows(n, temperature), rows(n, top_k), rows(n, top_p), seeds, steps).tolist()
    for row, token in enumerate(got):
        assert token in nucleus(logits[row], temperature, top_k, top_p), (row, token)


KINDS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.9),
         dict(temperature=0.9, top_k=40, top_p=0.95), dict(temperature=1.3, top_p=0.3), dict(temperature=1.0, top_k=1)]


def batch_logits(shape, batch, logit_seed):
    gen = torch.Generator().manual_seed(logit_seed)
    if shape == "peaked":  # one token holds all but 1e-8 of the mass: a float32 cumsum reaches 1 at once
        logits = torch.full((batch, QWEN3_VOCAB), -30.0)
        logits[torch.arange(batch), torch.randint(0, QWEN3_VOCAB, (batch,), generator=gen)] = 0.0
        return logits
    return torch.randn(batch, QWEN3_VOCAB, generator=gen) * {"flat": 0.05, "normal": 1.0, "sharp": 4.0}[shape]


@pytest.mark.parametrize("make", [Sampler, lambda: FusedSampler(16, "cpu", compiled=False)],
                         ids=["lesson 02", "lesson 06"])
@settings(max_examples=20, deadline=None)
@given(mine=st.integers(0, len(KINDS) - 1), mates=st.lists(st.integers(0, len(KINDS) - 1), min_size=1, max_size=6),
       where=st.integers(0, 6), seed=st.integers(0, 2**63 - 1), step=st.integers(0, 5000),
       shape=st.sampled_from(["flat", "normal", "sharp", "peaked"]), logit_seed=st.integers(0, 2**32 - 1))
# The issue's case: a top_p=1 row beside a top_p=0.9 one, where the old sampler cut the first row's tail too
# (its cumsum rounds to 1 at the top token), and seed 3, step 11 draws u = 1 for a token of that tail.
@example(mine=1, mates=[3], where=0, seed=3, step=11, shape="peaked", logit_seed=0)
def test_a_requests_token_does_not_depend_on_its_batch_mates(make, mine, mates, where, seed, step, shape, logit_seed):
    logits = batch_logits(shape, len(mates) + 1, logit_seed)
    where = where % (len(mates) + 1)
    params = [SamplingParams(**KINDS[k]) for k in mates]
    params.insert(where, SamplingParams(**KINDS[mine]))
    seeds = [seed ^ (i * 7919) for i in range(len(params))]
    steps = [step + i - where for i in range(len(params))]
    seeds[where] = seed
    alone = make()(logits[where:where + 1], params[where:where + 1], [seed], [steps[where]])
    together = make()(logits, params, seeds, steps)
    assert together[where] == alone[0]


def test_fused_sampler_compiled_and_eager_draw_alike():
    """Lesson 06's compiled draw is the same in every step, with or without a top-k/top-p batch-mate."""
    sampler = FusedSampler(8, "cpu", compiled=True)
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        logits = torch.randn(3, 5000, generator=gen) * 0.05
        plain = [SamplingParams(temperature=1.0)] * 2
        alone = sampler(logits[:2], plain, [trial, trial + 1], [trial, trial])
        mixed = sampler(logits, plain + [SamplingParams(temperature=1.0, top_p=0.5)], [trial, trial + 1, 9],
                        [trial, trial, trial])
        assert mixed[:2].tolist() == alone.tolist()


@pytest.fixture(scope="module")
def llm():
    from nanoserve import LLM

    with LLM("tiny-qwen3", max_model_len=256, num_gpu_blocks_override=64) as llm:
        yield llm


def test_through_llm_top_k_1_is_greedy_and_batch_mates_do_not_matter(llm):
    """The issue's repro through the public API: seed 3 draws u = 1 at step 11 (on main, top_k=1 left the
    greedy path on every prompt), and a top_p=1 request changed tokens beside a top_p=0.9 one."""
    def run(prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    prompts = [f"Prompt number {i}:" for i in range(3, 5)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=16, ignore_eos=True)
    assert run(prompts, top1) == run(prompts, greedy)
    for seed in (3, 5):  # the two of eight seeds that changed on main
        plain = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=100 + seed, max_tokens=16, ignore_eos=True)
        assert run(prompts[:1], plain) == run([prompts[0], "Another prompt"], [plain, nucleus])[:1], seed


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 300), batch=st.integers(1, 6), data=st.data())
def test_the_cpus_row_by_row_filter_is_the_sort_bit_for_bit(vocab, batch, data):
    """On a CPU keep_top_k_top_p sorts only the rows that ask for top-p and finds a top-k alone by its
    threshold (ties kept lowest id first): every row must come out as sorting the whole batch gives it."""
    from nanoserve.engine.sampler import keep_top_k_top_p, sort_and_cut

    logits = logits_with_ties(data, vocab, batch)
    if data.draw(st.booleans()):
        logits[:, ::3] = float("-inf")  # banned tokens (logit_bias, bad_words): ties at -inf
    top_k = torch.tensor(data.draw(st.lists(st.integers(0, vocab + 2), min_size=batch, max_size=batch)))
    top_p = torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 0.05, 0.5, 0.9]), min_size=batch,
                                            max_size=batch)))
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=batch,
                                                  max_size=batch)))
    assert torch.equal(keep_top_k_top_p(logits, temperature, top_k, top_p),
                       sort_and_cut(logits, temperature, top_k, top_p))

"""The sampler's promises on a GPU, over many seeds and bf16 logits of several shapes, for lesson 02's Sampler and
lesson 06's FusedSampler (eager and compiled): the hash's uniforms stay below 1, top_k=1 is the argmax, no token
outside top-k/top-p is drawn, and a row's token does not depend on its batch-mates; then the same through LLM."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.engine.fused_sampler import FusedSampler  # noqa: E402
from nanoserve.engine.sampler import Sampler, hash_uniform  # noqa: E402

V = 151936
EDGE_DRAWS = [(11, 3), (3, 11), (5, 12)]  # (seed, step) whose uniforms once rounded up to 1.0 for some token


def _logits(shape, n, gen):
    if shape == "peaked":  # all but 1e-8 of the mass on one token
        out = torch.full((n, V), -30.0, device="cuda")
        out[torch.arange(n), torch.randint(0, V, (n,), generator=gen, device="cuda")] = 0.0
        return out.bfloat16()
    if shape == "ties":
        return (torch.randint(-8, 8, (n, V), generator=gen, device="cuda").float() / 4).bfloat16()
    scale = {"flat": 0.05, "normal": 1.0, "sharp": 4.0}[shape]
    return (torch.randn(n, V, generator=gen, device="cuda") * scale).bfloat16()


def _in_nucleus(row, temperature, top_k, top_p, token):
    order = row.double().argsort(descending=True, stable=True)
    keep = order[:top_k] if top_k else order
    probs = (row.double()[keep] / temperature).softmax(-1)
    before = probs.cumsum(-1) - probs
    return token in set(keep[before < top_p + 1e-4].tolist())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_uniforms_never_reach_one(compiled):
    def exponential(seeds, steps):
        return -torch.log(hash_uniform(seeds, steps, V))

    draw = torch.compile(exponential, dynamic=True) if compiled else exponential
    gen = torch.Generator(device="cuda").manual_seed(0)
    for r in range(8):
        seeds = torch.randint(0, 2**62, (512,), generator=gen, device="cuda")
        steps = torch.randint(0, 4096, (512,), generator=gen, device="cuda")
        if r == 0:
            seeds[:3] = torch.tensor([s for s, _ in EDGE_DRAWS], device="cuda")
            steps[:3] = torch.tensor([t for _, t in EDGE_DRAWS], device="cuda")
        assert hash_uniform(seeds, steps, V).max().item() < 1.0
        assert draw(seeds, steps).min().item() > 0.0  # -log(1) = 0 would make that token win every draw


@pytest.mark.parametrize("name", ["Sampler", "FusedSampler eager", "FusedSampler compiled"])
def test_samplers_keep_their_promises_on_bf16_logits(name):
    sampler = {"Sampler": lambda: Sampler(), "FusedSampler eager": lambda: FusedSampler(256, "cuda", compiled=False),
               "FusedSampler compiled": lambda: FusedSampler(256, "cuda", compiled=True)}[name]()

    def draw(*args):
        return sampler(*args).tolist()

    gen = torch.Generator(device="cuda").manual_seed(1)
    n = 64
    for r in range(2):
        for shape in ("flat", "normal", "sharp", "peaked", "ties"):
            logits = _logits(shape, n, gen)
            seeds = torch.randint(0, 2**62, (n,), generator=gen, device="cuda").tolist()
            steps = torch.randint(0, 4096, (n,), generator=gen, device="cuda").tolist()
            if r == 0:
                for i, (s, t) in enumerate(EDGE_DRAWS):
                    seeds[i], steps[i] = s, t
            temps = (torch.rand(n, generator=gen, device="cuda") * 1.9 + 0.1).tolist()
            got = draw(logits, [SamplingParams(temperature=t, top_k=1) for t in temps], seeds, steps)
            assert got == logits.argmax(-1).tolist(), f"top_k=1 is not the argmax ({shape})"
            ks = torch.randint(0, 60, (n,), generator=gen, device="cuda").tolist()
            ps = (torch.rand(n, generator=gen, device="cuda") * 0.99 + 0.01).tolist()
            params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in zip(temps, ks, ps)]
            got = draw(logits, params, seeds, steps)
            outside = [i for i in range(n) if not _in_nucleus(logits[i].float(), temps[i], ks[i], ps[i], got[i])]
            assert not outside, f"rows {outside} drew outside their top-k/top-p ({shape})"
            # plain rows alone against beside filtered ones; filtered rows one at a time against in the batch
            plain = [SamplingParams(temperature=t) for t in temps]
            alone = draw(logits, plain, seeds, steps)
            together = draw(logits, [plain[i] if i % 2 == 0 else params[i] for i in range(n)], seeds, steps)
            assert [alone[i] for i in range(0, n, 2)] == [together[i] for i in range(0, n, 2)]
            singles = [draw(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1])[0] for i in range(8)]
            assert singles == got[:8]


def test_through_llm_top_k_1_is_greedy_and_a_seeded_row_ignores_its_batch_mates():
    prompts = [f"Prompt number {i}:" for i in range(8)]
    with LLM("tiny-qwen3", max_model_len=512) as llm:
        assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling

        def run(ps, params):
            return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]

        greedy = run(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        for seed in range(4):
            top1 = SamplingParams(temperature=1.0, top_k=1, seed=seed, max_tokens=32, ignore_eos=True)
            assert run(prompts, top1) == greedy
        for seed in range(8):
            plain = SamplingParams(temperature=1.0, seed=seed, max_tokens=32, ignore_eos=True)
            nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=100 + seed, max_tokens=32, ignore_eos=True)
            assert run(prompts[3:4], plain) == run([prompts[3], "Another prompt"], [plain, nucleus])[:1]

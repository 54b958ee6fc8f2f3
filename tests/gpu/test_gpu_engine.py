"""On a GPU in float32, the engine's fast paths change nothing: CUDA graphs, compiled fused ops, the fused sampler
and async scheduling give the eager engine's tokens, for a request alone and in a crowded batch (preemption,
chunked prefill, prefix hits); and an engine built again in the same variable gets its memory back."""
import gc
import random

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from nanoserve import LLM, SamplingParams  # noqa: E402


def _requests(seed: int = 0):
    """24 requests: every third behind a shared prefix, and each kind of sampling: greedy, top-k, top-p, n=2,
    log-probs, min-p."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 5000) for _ in range(40)]
    prompts, params = [], []
    kinds = [dict(temperature=0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.7, n=2), dict(temperature=0, logprobs=3), dict(temperature=1.1, min_p=0.05, logprobs=2)]
    for i in range(24):
        own = [rng.randrange(1, 5000) for _ in range(rng.randint(1, 60))]
        prompts.append(shared[:rng.randint(17, 40)] + own if i % 3 == 0 else own)
        params.append(SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, seed=i, **kinds[i % 6]))
    return prompts, params


def _completions(outputs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


def _largest_logprob_difference(reference, candidate):
    worst = 0.0
    for ref, cand in zip(reference, candidate):
        for (_, ref_lp), (_, cand_lp) in zip(ref, cand):
            for a, b in zip(ref_lp or [], cand_lp or []):
                worst = max([worst] + [abs(float(a[t]) - float(b[t])) for t in set(a) & set(b)])
    return worst


@pytest.mark.parametrize("model", ["tiny-qwen3", "qwen3-0.6b-random"])
def test_fast_paths_give_the_eager_engines_tokens(model):
    prompts, params = _requests()
    common = dict(dtype=torch.float32, max_model_len=512)
    with LLM(model, enforce_eager=True, num_gpu_blocks_override=1024, **common) as eager:
        reference = [_completions(eager.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
    with LLM(model, num_gpu_blocks_override=1024, **common) as fast:
        engine = fast.engine
        assert engine.runner.graphs is not None and engine.async_scheduling and not fast.enforce_eager
        alone = [_completions(fast.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
        del engine
    with LLM(model, num_gpu_blocks_override=12, max_num_batched_tokens=48, max_num_seqs=12, **common) as tight:
        outputs = tight.generate(prompts, params, use_tqdm=False)
        batched, stats = _completions(outputs), tight.engine.stats
        assert stats.preemptions > 0 and sum(o.num_cached_tokens for o in outputs) > 0  # the pressure happened
    tokens = [[t for t, _ in r] for r in reference]
    assert [[t for t, _ in r] for r in alone] == tokens
    assert [[t for t, _ in r] for r in batched] == tokens
    # the stored H200 run: 1e-4 at most (tiny-qwen3's compiled ops round a little differently)
    assert _largest_logprob_difference(reference, alone) < 1e-3
    assert _largest_logprob_difference(reference, batched) < 1e-3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_gets_its_tokens_alone_or_in_a_crowded_batch(prefix_caching):
    rng = random.Random(0)
    prompts = [[rng.randrange(5000) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(1, 20), ignore_eos=True)
              for i in range(24)]
    common = dict(dtype=torch.float32, max_model_len=256, enable_prefix_caching=prefix_caching)
    with LLM("tiny-qwen3", num_gpu_blocks_override=512, **common) as big:
        alone = [big.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    with LLM("tiny-qwen3", num_gpu_blocks_override=24, max_num_batched_tokens=32, max_num_seqs=12, **common) as small:
        batched = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
        assert small.engine.stats.preemptions > 0
    assert batched == alone


def test_an_llm_built_again_in_one_variable_gets_the_memory_back():
    gib, llm, rows = 2**30, None, []
    for _ in range(3):
        llm = LLM("tiny-qwen3", max_model_len=512)  # the previous one is still alive while this one builds
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        rows.append((len(out.token_ids), llm.cache.block_manager.num_blocks))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert all(n == 8 for n, _ in rows)
    blocks = [b for _, b in rows]
    assert min(blocks) > 0.95 * max(blocks)  # each got the whole pool: the one before had given it back
    assert torch.cuda.memory_reserved() < gib

"""kv_cache_dtype (vLLM's name): a KV cache narrower than the model, bfloat16 or float8 e4m3 (lesson 06), on the
torch path. The Triton kernels' float8 reads and stores: tests/test_triton_attention.py."""
import pytest
import torch

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.kernels import paged

FP8 = torch.float8_e4m3fn


def test_store_saturates_and_rounds_as_torch_casts():
    """Each stored value is torch's cast of the value clamped to +-448 (no NaN past the range); padding
    slots (-1) write nothing; a bfloat16 cache takes the plain cast."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (FP8, torch.bfloat16):
        k_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)
        v_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)
        k = torch.randn(5, 2, 8, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 600.0, -5000.0])[:, None, None]
        v = torch.randn(5, 2, 8, generator=gen)
        slots = torch.tensor([7, -1, 0, 11, 2])
        paged.store_kv(k_cache, v_cache, slots, k, v)
        flat_k, flat_v = k_cache.view(-1, 2, 8).float(), v_cache.view(-1, 2, 8).float()
        top = torch.finfo(dtype).max
        kept = [0, 2, 3, 4]
        assert torch.equal(flat_k[slots[kept]], k[kept].clamp(-top, top).to(dtype).float())
        assert torch.equal(flat_v[slots[kept]], v[kept].to(dtype).float())
        assert not flat_k.isnan().any()
        if dtype == FP8:
            assert flat_k[11].abs().max() == 448 and flat_k[2].abs().max() == 448  # saturated, both signs
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[slots[kept]] = False
        assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
def test_attention_reads_a_narrow_cache_as_its_values(dtype):
    """Decode and prefill over a narrow cache equal the same attention over a float32 cache holding the
    narrow values: the kernels widen what they read, nothing else."""
    gen = torch.Generator().manual_seed(1)
    blocks, bs, kv_heads, d = 6, 4, 2, 16
    k32 = torch.randn(blocks, bs, kv_heads, d, generator=gen) * 4
    v32 = torch.randn(blocks, bs, kv_heads, d, generator=gen)
    k_narrow, v_narrow = k32.to(dtype), v32.to(dtype)
    k_wide, v_wide = k_narrow.float(), v_narrow.float()
    tables = torch.tensor([[3, 0, 5, -1], [1, 4, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([11, 6], dtype=torch.int32)
    q = torch.randn(2, 4, d, generator=gen)
    assert torch.equal(paged.paged_decode_attention(q, k_narrow, v_narrow, tables, lens),
                       paged.paged_decode_attention(q, k_wide, v_wide, tables, lens))
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)  # 5 new tokens after a prefix of 6, then 3 after 3
    q = torch.randn(8, 4, d, generator=gen)
    assert torch.equal(paged.paged_prefill_attention(q, k_narrow, v_narrow, cu, lens, tables),
                       paged.paged_prefill_attention(q, k_wide, v_wide, cu, lens, tables))


def test_fp8_engine_is_the_float32_engine_with_rounded_kv(monkeypatch):
    """LLM(kv_cache_dtype="fp8"): the pool holds e4m3 (4x the blocks of float32 in the same memory), and its
    tokens and log-probs are exactly those of a float32 cache whose K/V were rounded to e4m3 on the way in
    (prefill, chunked prefill, decode, prefix hits, n=2), and not those of the plain float32 cache."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 9, [5, 6, 7, 8, 9, 10, 11, 12] * 9 + [40, 41], "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=12, ignore_eos=True)]
    # on the CPU (the torch store it patches), also where a GPU is: a GPU engine stores K/V through Triton
    settings = dict(device="cpu", max_model_len=256, cpu_kv_cache_gib=1 / 256, max_num_batched_tokens=32, block_size=8)

    def run(kv_cache_dtype):
        with LLM("tiny-qwen3", kv_cache_dtype=kv_cache_dtype, **settings) as llm:
            outs = llm.generate(prompts, [params[0], params[0], params[1]], use_tqdm=False)
            return llm.cache, [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]

    fp8_cache, fp8_outs = run("fp8")
    float_cache, float_outs = run("auto")
    assert fp8_cache.k_cache.dtype == FP8 and float_cache.k_cache.dtype == torch.float32
    assert fp8_cache.block_manager.num_blocks == 4 * float_cache.block_manager.num_blocks
    assert fp8_cache.nbytes == float_cache.nbytes
    store = paged.store_kv
    monkeypatch.setattr(paged, "store_kv", lambda kc, vc, slots, k, v: store(
        kc, vc, slots, paged.to_cache_dtype(k, FP8).to(k.dtype), paged.to_cache_dtype(v, FP8).to(v.dtype)))
    _, rounded_outs = run("auto")
    assert fp8_outs == rounded_outs
    assert fp8_outs != float_outs  # (so the rounding is seen: the test could tell the two apart)


@pytest.mark.parametrize("bad", ["fp8_e5m2", "float8", "", None, torch.float8_e4m3fn])
def test_unknown_kv_cache_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs("tiny-qwen3", kv_cache_dtype=bad)

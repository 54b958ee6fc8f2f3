"""Triton paged-attention kernels against the plain-torch CPU path (nanoserve/paged_attention.py).

On a machine without a CUDA GPU the kernels run in Triton's interpreter (numpy on the CPU) in fp32
and fp16 (the interpreter is wrong for bf16). With a GPU they run compiled, in bf16 too, on bigger
shapes. Cases are random but seeded: each test id names its seed, so a failure can be replayed.
"""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Triton reads this when it is first imported (its own library functions, like tl.sum, are
    # @triton.jit too) and when @triton.jit decorates our kernels. Set it before both.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nanoserve.kernels import paged as reference  # noqa: E402  (the torch CPU path)
from nanoserve.kernels import triton_paged as ta  # noqa: E402

# In a full pytest session another test module may have imported triton before this one (importing
# transformers' models imports torch._dynamo, which imports triton): then this process can only
# compile kernels, which needs a GPU. On a CPU the kernel tests then run in a fresh child process.
IN_CHILD = not ON_GPU and not isinstance(tl.sum, InterpretedFunction)


@pytest.fixture(autouse=True)
def _interpreter_or_child(request):
    if IN_CHILD and request.node.name != "test_kernels_in_fresh_interpreter":
        pytest.skip("triton was imported before TRITON_INTERPRET was set; test_kernels_in_fresh_interpreter runs this")


def test_kernels_in_fresh_interpreter():
    if not IN_CHILD:
        pytest.skip("the kernel tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             __file__], env=env, cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Sizes: the interpreter runs each program in Python, so CPU cases stay small.
MAX_BATCH = 64 if ON_GPU else 3
MAX_LEN = 4096 if ON_GPU else 2000
KV_HEADS = 8 if ON_GPU else 2


def assert_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[out.dtype], rtol=ATOL[out.dtype])


def make_cache(lengths, kv_heads, head_dim, block_size, dtype, gen):
    """Random K/V in a paged cache holding the sequences `lengths`, in shuffled blocks.

    Returns k_cache, v_cache, block_tables (padded with -1, one spare column), context_lens.
    """
    pages = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(pages) + 3  # a few blocks no sequence owns
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lengths), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        tables[b, :p] = ids[used:used + p]
        used += p
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k_cache, v_cache, tables.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def random_lengths(rng, batch, block_size, lo=1, hi=MAX_LEN):
    """Lengths in [lo, hi], a third of them exactly on a block boundary or one past it."""
    out = []
    for _ in range(batch):
        n = rng.randint(lo, hi)
        kind = rng.random()
        if kind < 0.2:
            n = max(lo, n // block_size * block_size)  # ends exactly at a block's end
        elif kind < 0.33:
            n = min(hi, n // block_size * block_size + 1)  # one token into a fresh block
        out.append(n)
    return out


# One case per (group, head_dim), dtypes and block sizes cycling through the rest.
CASES = [(group, head_dim, DTYPES[i % len(DTYPES)], (16, 8, 32)[i % 3], seed)
         for seed, (i, (group, head_dim)) in enumerate(
             enumerate([(g, d) for g in (1, 2, 3, 4, 8) for d in (64, 128)]))]
CASE_IDS = [f"group{g}-d{d}-{str(dt)[6:]}-bs{bs}-seed{s}" for g, d, dt, bs, s in CASES]


# ---------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv(dtype, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(block_size)
    T, kv_heads, head_dim, num_blocks = 37, 2, 64, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::5] = -1  # padding tokens: must leave the cache alone
    # k, v as the halves of a fused projection: each token's row is contiguous, rows are strided
    kv = torch.randn(T, 2 * kv_heads * head_dim + 8, generator=gen).to(DEVICE, dtype)
    k = kv[:, :kv_heads * head_dim].view(T, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(T, kv_heads, head_dim)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(expect_k, expect_v, slots.to(DEVICE, slot_dtype), k, v)
    ta.store_kv(k_cache, v_cache, slots.to(DEVICE, slot_dtype), k, v)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    assert not torch.equal(expect_k, expect_k.new_zeros(expect_k.shape))  # the test wrote something


def test_store_kv_transposed_input():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    k = torch.randn(64, 2, 5, generator=gen).to(DEVICE).transpose(0, 2)  # [5, 2, 64], not row-major
    v = torch.randn(5, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([63, 0, -1, 17, 40], device=DEVICE)
    ta.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots[[0, 1, 3, 4]]], k[[0, 1, 3, 4]])
    assert k_cache.view(-1, 2, 64)[1:17].abs().sum() == 0  # nothing else written


@pytest.mark.parametrize("head_dim, kv_heads", [(96, 2), (80, 3), (192, 1)])
def test_store_kv_any_head_dim(head_dim, kv_heads):
    # rows of kv_heads * head_dim values that are no power of two (240 for 80 x 3)
    gen = torch.Generator().manual_seed(head_dim)
    k_cache = torch.randn(5, 16, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(5, 16, kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 15, 16, -1, 79, 33], device=DEVICE)  # both ends of a block, the pool's last slot
    k = torch.randn(6, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(6, kv_heads, head_dim, generator=gen).to(DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(expect_k, expect_v, slots, k, v)
    ta.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


# ---------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("group, head_dim, dtype, block_size, seed", CASES, ids=CASE_IDS)
def test_decode_random(group, head_dim, dtype, block_size, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    batch = rng.randint(1, MAX_BATCH)
    lengths = random_lengths(rng, batch, block_size)
    k_cache, v_cache, tables, lens = make_cache(lengths, KV_HEADS, head_dim, block_size, dtype, gen)
    q = torch.randn(batch, KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype)
    assert_close(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens),
                 reference.paged_decode_attention(q, k_cache, v_cache, tables, lens))


def test_decode_edge_lengths():
    # 1 token, exactly one block, one past, many blocks ending on a boundary; splits forced on
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 16, 17, 15, 64, 65, 128, 1024]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 64, 16, torch.float32, gen)
    q = torch.randn(len(lengths), 4, 64, generator=gen).to(DEVICE)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    for splits in (1, 2, 5, 16):  # 16 splits: most are empty for most sequences
        assert_close(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=splits), ref)


def test_decode_split_counters_back_at_zero():
    # The last split of each (sequence, kv head) combines the partials and zeroes its counter: a count left
    # over would make a later call combine too early (or never). The same inputs again give the same answer.
    gen = torch.Generator().manual_seed(3)
    lengths = [700, 3, 64, 129]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 64, 16, torch.float32, gen)
    q = torch.randn(len(lengths), 6, 64, generator=gen).to(DEVICE)
    first = ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=7)
    assert all(not c.any() for c in ta._COUNTERS[q.device])
    assert torch.equal(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=7), first)
    assert_close(first, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_graph_padding_rows(splits):
    # As a CUDA graph replays it (lesson 06): launched for the longest context (max_context_len fixed at
    # capture), with padding rows of context length 0 and no blocks. Real rows are exact, padding is 0.
    gen = torch.Generator().manual_seed(splits)
    lengths = [5, 40, 1]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 64, 16, torch.float32, gen)
    q = torch.randn(5, 4, 64, generator=gen).to(DEVICE)
    padded_tables = torch.cat([tables, torch.full((2, tables.shape[1]), -1, dtype=tables.dtype, device=DEVICE)])
    padded_lens = torch.cat([lens, torch.zeros(2, dtype=lens.dtype, device=DEVICE)])
    out = ta.paged_decode_attention(q, k_cache, v_cache, padded_tables, padded_lens, max_context_len=512,
                                    num_splits=splits)
    assert_close(out[:3], reference.paged_decode_attention(q[:3], k_cache, v_cache, tables, lens))
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_variants(block_n):
    gen = torch.Generator().manual_seed(block_n)
    lengths = [700, 3, 320]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 128, 16, torch.float16, gen)
    q = torch.randn(3, 6, 128, generator=gen).to(DEVICE, torch.float16)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_n=block_n,
                                    max_context_len=700, num_splits=3)
    assert_close(out, ref)


def test_decode_strided_q_and_scale():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, lens = make_cache([40, 90], 2, 64, 16, torch.float32, gen)
    q = torch.randn(2, 64, 4, generator=gen).to(DEVICE).transpose(1, 2)  # [2, 4, 64], last dim strided
    assert_close(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.3),
                 reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.3))
    qkv = torch.randn(2, 7 * 64, generator=gen).to(DEVICE)  # q as a slice of a fused projection
    q = qkv[:, :4 * 64].view(2, 4, 64)
    assert_close(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens),
                 reference.paged_decode_attention(q, k_cache, v_cache, tables, lens))


# ---------------------------------------------------------------------------------- prefill

def make_prefill(rng, gen, batch, group, head_dim, block_size, dtype, max_new, max_len):
    """Random new-token counts and cached prefixes (none, on a block boundary, or anywhere)."""
    news, lengths = [], []
    for _ in range(batch):
        n = rng.randint(1, max_new)
        prefix = rng.choice([0, rng.randint(0, max_len - n) // block_size * block_size, rng.randint(0, max_len - n)])
        news.append(n)
        lengths.append(prefix + n)
    k_cache, v_cache, tables, lens = make_cache(lengths, KV_HEADS, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(news), KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0] + news, dtype=torch.int32).cumsum(0).to(DEVICE, torch.int32)
    return q, k_cache, v_cache, cu, lens, tables


@pytest.mark.parametrize("group, head_dim, dtype, block_size, seed", CASES, ids=CASE_IDS)
def test_prefill_random(group, head_dim, dtype, block_size, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    batch = rng.randint(1, 8 if ON_GPU else 3)
    max_new = 1024 if ON_GPU else 150
    q, k_cache, v_cache, cu, lens, tables = make_prefill(rng, gen, batch, group, head_dim, block_size, dtype,
                                                         max_new, MAX_LEN)
    assert_close(ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables),
                 reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables))


def test_prefill_edge_cases():
    # no prefix; one new token (a decode through prefill); new tokens filling whole q tiles (128)
    # and one past them; a prefix ending on a block boundary and one ending mid-block
    gen = torch.Generator().manual_seed(0)
    news = [5, 1, 128, 129, 20, 7]
    lengths = [5, 40, 128, 129 + 16, 20 + 64, 7 + 33]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, 64, 16, torch.float32, gen)
    q = torch.randn(sum(news), 4, 64, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + news).cumsum(0).to(DEVICE, torch.int32)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables)
    # the default tiles (the kv head's 2 query heads in one program), smaller ones, and one head a program
    for knobs in ({}, dict(block_m=16, block_n=32), dict(block_m=32, block_n=16, pack=False)):
        assert_close(ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, **knobs), ref)
    # a group of 3 packed pads each token's rows to 4 (the padded row is computed, never stored)
    q3 = torch.randn(sum(news), 6, 64, generator=gen).to(DEVICE)
    ref3 = reference.paged_prefill_attention(q3, k_cache, v_cache, cu, lens, tables)
    for pack in (True, False):
        assert_close(ta.paged_prefill_attention(q3, k_cache, v_cache, cu, lens, tables, block_m=32, block_n=16,
                                                pack=pack), ref3)
    # the first query of a fresh sequence sees only itself: its output is its own value
    assert torch.allclose(ref[0], v_cache[tables[0, 0], 0].repeat_interleave(2, dim=0))


def test_prefill_strided_q_and_scale():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, lens = make_cache([30, 50], 2, 64, 16, torch.float32, gen)
    cu = torch.tensor([0, 10, 35], dtype=torch.int32, device=DEVICE)
    q = torch.randn(35, 64, 4, generator=gen).to(DEVICE).transpose(1, 2)
    assert_close(ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale=0.2),
                 reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale=0.2))


# ---------------------------------------------------------------------------------- any head dim
# Head dims that are not a power of two run on tiles padded to the next one (96 -> 128, 80 -> 128,
# 192 -> 256), masked to the real columns. 256 is the widest tile, unpadded. fp32 in the interpreter.

ODD_DTYPES = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])
ODD_CASES = [(group, head_dim, dtype) for head_dim in (96, 80, 192, 256) for group in (1, 4) for dtype in ODD_DTYPES]
ODD_IDS = [f"group{g}-d{d}-{str(dt)[6:]}" for g, d, dt in ODD_CASES]


@pytest.mark.parametrize("group, head_dim, dtype", ODD_CASES, ids=ODD_IDS)
def test_decode_any_head_dim(group, head_dim, dtype):
    # 1 token, a block's end and one past it, several blocks, a length mid-block; with and without splits
    gen = torch.Generator().manual_seed(head_dim + group)
    lengths = [1, 16, 17, 48, 130]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, head_dim, 16, dtype, gen)
    q = torch.randn(len(lengths), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    for splits in (1, 3):  # 3: the partials (kept D_PAD wide) go through the reduce kernel
        assert_close(ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=splits, block_n=32), ref)


@pytest.mark.parametrize("group, head_dim, dtype", ODD_CASES, ids=ODD_IDS)
def test_prefill_any_head_dim(group, head_dim, dtype):
    # no prefix; a prefix ending on a block boundary and one ending mid-block; new tokens crossing a
    # 16-row q tile; one new token
    gen = torch.Generator().manual_seed(head_dim + group)
    news = [20, 17, 5, 1]
    lengths = [20, 17 + 32, 5 + 21, 1 + 16]
    k_cache, v_cache, tables, lens = make_cache(lengths, 2, head_dim, 16, dtype, gen)
    q = torch.randn(sum(news), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0] + news).cumsum(0).to(DEVICE, torch.int32)
    assert_close(ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, block_m=16, block_n=16),
                 reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables))


def test_inputs_that_cannot_work_raise_value_error():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables, lens = make_cache([20], 2, 96, 16, torch.float32, gen)
    q = torch.randn(1, 4, 96, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    strided = k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, not packed
    with pytest.raises(ValueError, match="contiguous"):
        ta.paged_decode_attention(q, strided, v_cache, tables, lens)
    with pytest.raises(ValueError, match="contiguous"):
        ta.paged_prefill_attention(q, k_cache, strided, cu, lens, tables)
    with pytest.raises(ValueError, match="contiguous"):
        ta.store_kv(strided, v_cache, torch.zeros(1, dtype=torch.int64, device=DEVICE), q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="head_dim 80"):
        ta.paged_decode_attention(q[..., :80], k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="kv heads"):
        ta.paged_prefill_attention(q[:, :3], k_cache, v_cache, cu, lens, tables)
    with pytest.raises(ValueError, match="block_m 1"):  # a group of 2 in one program: 2 rows a token
        ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, block_m=1)
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        ta.store_kv(k_cache, v_cache, torch.zeros(1, dtype=torch.int64, device=DEVICE), q[:, :3], q[:, :3])


# ------------------------------------------------------------------ a float8 e4m3 cache (lesson 06)

FP8 = torch.float8_e4m3fn
FP8_CASES = [CASES[i] for i in (0, 3, 6, 9)]  # groups 1, 2, 4, 8; head dims 64 and 128; q in every dtype


def as_fp8(k_cache, v_cache):
    """The caches as an fp8 cache holds them: K spread wide enough (x 40) that some values saturate."""
    return (k_cache.float() * 40).clamp(-448, 448).to(FP8), v_cache.float().to(FP8)


@pytest.mark.parametrize("group, head_dim, dtype, block_size, seed", FP8_CASES,
                         ids=[CASE_IDS[i] for i in (0, 3, 6, 9)])
def test_decode_and_prefill_read_an_fp8_cache(group, head_dim, dtype, block_size, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    lengths = random_lengths(rng, rng.randint(1, MAX_BATCH), block_size)
    k_cache, v_cache, tables, lens = make_cache(lengths, KV_HEADS, head_dim, block_size, dtype, gen)
    k8, v8 = as_fp8(k_cache, v_cache)
    q = torch.randn(len(lengths), KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype) / 40
    assert_close(ta.paged_decode_attention(q, k8, v8, tables, lens),
                 reference.paged_decode_attention(q, k8.to(dtype), v8.to(dtype), tables, lens))
    q, k_cache, v_cache, cu, lens, tables = make_prefill(rng, gen, rng.randint(1, 3), group, head_dim, block_size,
                                                         dtype, 1024 if ON_GPU else 100, MAX_LEN)
    k8, v8 = as_fp8(k_cache, v_cache)
    q = q / 40
    assert_close(ta.paged_prefill_attention(q, k8, v8, cu, lens, tables),
                 reference.paged_prefill_attention(q, k8.to(dtype), v8.to(dtype), cu, lens, tables))


@pytest.mark.parametrize("fp16_mma", [True, False])
def test_fp8_cache_products_in_float16(fp16_mma):
    """The products over an fp8 cache in float16 (what a bf16 q gets on a GPU) or in q's dtype: both the
    attention over the cache's values, for decode (one split and several) and prefill. Also a q past
    float16's range is clamped into it, so no inf comes out."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    lengths = random_lengths(rng, 3, 16)
    k_cache, v_cache, tables, lens = make_cache(lengths, KV_HEADS, 64, 16, torch.float32, gen)
    k8, v8 = as_fp8(k_cache, v_cache)
    q = torch.randn(len(lengths), KV_HEADS * 2, 64, generator=gen).to(DEVICE) / 40
    expect = reference.paged_decode_attention(q, k8.float(), v8.float(), tables, lens)
    for splits in (1, 3):
        got = ta.paged_decode_attention(q, k8, v8, tables, lens, num_splits=splits, fp16_mma=fp16_mma)
        torch.testing.assert_close(got, expect, atol=ATOL[torch.float16], rtol=ATOL[torch.float16])
    big = q.clone()
    big[0, 0, 0] = 1e6
    assert ta.paged_decode_attention(big, k8, v8, tables, lens, fp16_mma=fp16_mma).isfinite().all()
    q, k_cache, v_cache, cu, lens, tables = make_prefill(rng, gen, 2, 2, 64, 16, torch.float32, 100, MAX_LEN)
    k8, v8 = as_fp8(k_cache, v_cache)
    torch.testing.assert_close(ta.paged_prefill_attention(q / 40, k8, v8, cu, lens, tables, fp16_mma=fp16_mma),
                               reference.paged_prefill_attention(q / 40, k8.float(), v8.float(), cu, lens, tables),
                               atol=ATOL[torch.float16], rtol=ATOL[torch.float16])


@pytest.mark.skipif(not ON_GPU, reason="Triton's interpreter rounds to float8 wrongly on a CPU (0.031 becomes "
                                       "0.0156): the fp8 store is checked on the GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_into_an_fp8_cache_rounds_as_the_torch_twin(dtype):
    gen = torch.Generator().manual_seed(8)
    T, kv_heads, head_dim = 300, 2, 128
    k_cache = torch.zeros(40, 16, kv_heads, head_dim, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # every magnitude e4m3 has: subnormals (< 2**-6), normal values, and past 448 (saturates)
    k = torch.randn(T, kv_heads, head_dim, generator=gen) * torch.logspace(-4, 3.5, T)[:, None, None]
    k = k.to(DEVICE, dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(40 * 16, generator=gen)[:T]
    slots[::7] = -1
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(expect_k, expect_v, slots.to(DEVICE), k, v)
    ta.store_kv(k_cache, v_cache, slots.to(DEVICE), k, v)
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))
    assert k_cache.float().abs().max() == 448 and not k_cache.float().isnan().any()


# ------------------------------------------------------------------ lesson 06's decode-step kernels

# an output's error against the float64 product, as a share of the sum of its terms' sizes: float32 sums
# in any order stay far below 1e-6 of it; a 16-bit output adds its own rounding (2**-11, 2**-9 of |y|)
PRODUCT_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def product_cases(shapes: list) -> list:
    """(dtype, shape) for each dtype and shape; on a CPU the big shapes (over a million weights: the wide
    products' tile, K over several tiles) in float32 only. The interpreter takes seconds a case there, and the
    tiles are the same in every dtype; float16's rounding is checked on the small shapes (and every case on a GPU)."""
    return [(dtype, shape) for shape in shapes for dtype in DTYPES
            if ON_GPU or dtype == torch.float32 or shape[0][0] * shape[0][1] <= 1_000_000]


def assert_product_close(out, x, w):
    """out = x @ w.T, against the float64 product, within PRODUCT_TOL of each output's scale: the sum of its
    terms' sizes, which a float sum's rounding grows with. (torch's own float32 product is no reference here:
    with thousands of terms that cancel it rounds as much as the kernel, and differently on another CPU's
    BLAS.) One of K terms left out or taken twice moves an output by about scale / K: far more than that."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).clamp(min=1e-30)
    worst = ((out.double() - exact).abs() / scale).max().item()
    tol = PRODUCT_TOL[out.dtype]
    assert worst <= tol, f"error {worst:.2e} of the terms' size (allowed {tol:.0e})"


@pytest.mark.parametrize("dtype, shape", [(d, s[0]) for d, s in product_cases(
    [((96, 64),), ((8, 1000),), ((4100, 512),), ((3, 2),)])])  # N wide/narrow, K ragged/tiny
def test_gemv_equals_linear(dtype, shape):
    from nanoserve.kernels import triton_fused

    N, K = shape
    gen = torch.Generator().manual_seed(N * K)
    x, w = torch.randn(1, K, generator=gen).to(DEVICE, dtype), torch.randn(N, K, generator=gen).to(DEVICE, dtype)
    assert_product_close(triton_fused.gemv(x, w), x, w)
    with pytest.raises(ValueError, match="gemv takes x"):
        triton_fused.gemv(x.repeat(2, 1), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,k_heads,head_dim,norm", [(1, 4, 2, 64, True), (5, 3, 1, 128, True),
                                                                  (2, 2, 2, 64, False), (0, 2, 1, 64, True)])
def test_qk_norm_rope_equals_the_torch_op(dtype, tokens, q_heads, k_heads, head_dim, norm):
    from nanoserve.kernels import triton_fused
    from nanoserve.model.qwen3_fused import qk_norm_rope, rope_table

    gen = torch.Generator().manual_seed(tokens * 100 + q_heads)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(DEVICE, dtype) * 3
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)  # strided rows: views of the packed qkv
    k = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if norm else [None, None]
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    cos, sin = rope_table(512, head_dim, 1e6, dtype).to(DEVICE)[positions].unbind(dim=1)
    got = triton_fused.triton_qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
    want = qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
    for a, b in zip(got, want):
        assert_close(a, b)


@pytest.mark.parametrize("dtype, shape, with_residual", [(d, *s) for d, s in product_cases(
    [((96, 64), True), ((4100, 512), True), ((8, 1000), False), ((3, 2), True), ((3, 5000), True)])])  # 5000: 2 tiles
def test_norm_gemv_equals_add_rms_norm_then_linear(dtype, shape, with_residual):
    """The norm done on the way into the product: the product of the normed row, and x + residual."""
    from nanoserve.kernels import triton_fused
    from nanoserve.model.qwen3_fused import add_rms_norm, rms_norm

    N, K = shape
    gen = torch.Generator().manual_seed(N + K)
    x, residual = (torch.randn(1, K, generator=gen).to(DEVICE, dtype) * 4 for _ in range(2))
    norm_weight = (torch.rand(K, generator=gen) + 0.5).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=gen).to(DEVICE, dtype)
    if with_residual:
        normed, h = add_rms_norm(x, residual, norm_weight, 1e-6)
    else:
        normed, h = rms_norm(x, norm_weight, 1e-6), x
    y, h_out = triton_fused.norm_gemv(x, residual if with_residual else None, norm_weight, 1e-6, w)
    assert torch.equal(h_out, h)  # the next residual, exactly x + residual in the input's dtype
    assert_product_close(y, normed, w)


@pytest.mark.parametrize("dtype, shape", [(d, s[0]) for d, s in product_cases(
    [((64, 96),), ((1024, 3000),), ((5, 3),)])])
def test_silu_gemv_equals_silu_and_mul_then_linear(dtype, shape):
    from nanoserve.kernels import triton_fused
    from nanoserve.model.qwen3_fused import silu_and_mul

    N, K = shape
    gen = torch.Generator().manual_seed(N * 7 + K)
    gate_up = torch.randn(1, 2 * K, generator=gen).to(DEVICE, dtype) * 3
    w = torch.randn(N, K, generator=gen).to(DEVICE, dtype)
    assert_product_close(triton_fused.silu_gemv(gate_up, w), silu_and_mul(gate_up), w)
    with pytest.raises(ValueError, match=rf"gemv takes x \[1, {2 * K}\]"):
        triton_fused.silu_gemv(gate_up[:, :K], w)


@pytest.mark.parametrize("seed", range(4))
def test_triton_pick_draws_lesson_02s_tokens(seed):
    # Lesson 06's sampler kernel against lesson 02's pick, which defines the draw: greedy and sampled rows
    # side by side, masked tokens (-inf, never drawn), seeds past 2**32, a vocabulary that is no multiple of
    # the kernel's tile, ties (argmax's lowest id), and one row or many (the vocabulary cut into more slices).
    from nanoserve.engine.sampler import pick
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, V = rng.choice([1, 3, 9]), rng.choice([1000, 5003, 151_936 if ON_GPU else 20_011])
    dtype = torch.bfloat16 if ON_GPU and seed % 2 else torch.float32
    logits = (torch.randn(B, V, generator=gen) * rng.choice([0.5, 3.0])).to(dtype)
    logits[:, rng.randrange(V)] = float("-inf")
    logits[0, 7] = logits[0, 900] = logits[0].max() + 1  # a tie for the greedy row: token 7 wins
    temperature = torch.tensor([0.0] + [rng.choice([0.0, 0.3, 0.6, 1.0, 1.7]) for _ in range(B - 1)])
    seeds = torch.tensor([rng.randrange(2**63) for _ in range(B)])
    steps = torch.tensor([rng.randrange(10_000) for _ in range(B)])
    want = pick(logits, temperature, seeds, steps)
    got = triton_fused.triton_pick(logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), steps.to(DEVICE))
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert got[0] == 7


def test_triton_pick_ties_within_one_program_go_to_the_lower_token():
    # 64 rows: each program then scores several tiles of its slice, so tokens 7 and 7 + 1024 meet in the same
    # lane of the same program (the kernel's strict `>` keeps the first), and 5 and 3000 in different ones.
    from nanoserve.engine.sampler import pick
    from nanoserve.kernels import triton_fused

    gen = torch.Generator().manual_seed(11)
    B, V = 64, 20_011
    logits = torch.randn(B, V, generator=gen)
    top = logits.max() + 1
    logits[0, 7] = logits[0, 7 + 1024] = top
    logits[1, 5] = logits[1, 3000] = top
    temperature, seeds, steps = torch.zeros(B), torch.arange(B), torch.zeros(B, dtype=torch.int64)
    temperature[2:] = 0.7
    want = pick(logits, temperature, seeds, steps)
    got = triton_fused.triton_pick(logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), steps.to(DEVICE))
    assert got[:2].tolist() == [7, 5] and got.tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_triton_logsumexp_rank_is_the_torch_functions(seed):
    # The logprobs feature's kernel against its torch path: the logsumexp within float32 rounding, the ranks
    # exactly; a vocabulary that is no multiple of the tile, one row or several, a chosen token tied with
    # others (ties are not "above"), the likeliest token (rank 1) and the least likely one.
    from nanoserve.features.logprobs import logsumexp_rank
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, V = rng.choice([1, 3, 7]), rng.choice([1000, 4097, 151_936 if ON_GPU else 9_001])
    dtype = rng.choice(DTYPES)
    logits = (torch.randn(B, V, generator=gen) * rng.choice([0.5, 4.0])).to(dtype)
    chosen = logits[torch.arange(B), torch.randint(0, V, (B,), generator=gen)].float()
    chosen[0] = logits[0].max().float()
    if B > 1:
        chosen[1] = logits[1].min().float()
        logits[-1, :5] = logits[-1, 5]  # ties with the chosen token below
        chosen[-1] = logits[-1, 5].float()
    want_lse, want_rank = logsumexp_rank(logits, chosen)
    lse, rank = triton_fused.triton_logsumexp_rank(logits.to(DEVICE), chosen.to(DEVICE))
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
    assert rank.cpu().tolist() == want_rank.tolist() and rank[0] == 1


@pytest.mark.parametrize("seed", range(3))
def test_triton_apply_bitmask_is_lesson_02s_unpacked_mask(seed):
    # The grammar's kernel against exercise 2.4's unpack_bitmask and a masked_fill: only the given rows change,
    # tokens past the words' bits are banned (a model's vocabulary padded beyond its tokenizer's), words with
    # the top bit set (negative int32), a vocabulary that is no multiple of 32 or of the tile.
    from nanoserve.features.structured_outputs import unpack_bitmask
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    V = rng.choice([64, 5000, 151_936 if ON_GPU else 9_001])
    W = (V + 31) // 32 - rng.choice([0, 0, 1])
    B = rng.choice([2, 5, 9])
    rows = torch.tensor(rng.sample(range(B), rng.randint(1, B)))
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), W), generator=gen, dtype=torch.int64).to(torch.int32)
    words[0] = -1  # every bit set: the row's tokens within the words are all allowed
    logits = torch.randn(B, V, generator=gen)
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~unpack_bitmask(words, V), float("-inf"))
    got = logits.to(DEVICE)
    triton_fused.triton_apply_bitmask(got, words.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("seed", range(3))
def test_triton_penalties_are_exercise_2_5s_torch_path(seed):
    # The penalties' two kernels against their torch path (exercise 2.5): histories rebuilt from random outputs,
    # then draws counted by both (tokens drawn again and again, tokens of the prompt drawn, new tokens), then one
    # edit of a step whose rows are in another order than the slots, beside rows that use no penalty, with -inf
    # logits and penalties below 1 and negative.
    from types import SimpleNamespace

    from nanoserve.features.processors import Rows
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.features.penalties import Penalties
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    V, M = rng.choice([50, 3000]), rng.randint(2, 6)
    penalties = Penalties(M, V, torch.device("cpu"))
    slots, seqs = rng.sample(range(M), rng.randint(1, M)), []
    for slot in slots:
        params = SamplingParams(repetition_penalty=rng.choice([0.6, 1.0, 1.7]),
                                frequency_penalty=rng.choice([0.0, -1.0, 0.5]),
                                presence_penalty=rng.choice([0.0, 1.5, -0.5]))
        output = [rng.randrange(20) for _ in range(rng.randint(0, 30))]
        seqs.append(SimpleNamespace(params=params, prompt_ids=[rng.randrange(V) for _ in range(rng.randint(1, 40))],
                                    output_ids=output))
        penalties.add(slot, seqs[-1])
    penalties.rebuild(Rows(None, None, slots, seqs, [len(s.output_ids) for s in seqs], None), list(range(len(slots))))
    penalties.reserve(penalties.history.shape[1] + 40)
    on_device = {name: getattr(penalties, name).clone().to(DEVICE) for name in ("history", "count", "length", "factors")}
    slot_ids = torch.tensor(slots)
    for _ in range(25):
        tokens = torch.randint(0, 25, (len(slots),), generator=gen)
        penalties.append(slot_ids, tokens)
        triton_fused.triton_count_drawn(slot_ids.to(DEVICE), tokens.to(DEVICE), on_device["history"],
                                        on_device["count"], on_device["length"])
    for name in ("history", "count", "length"):
        assert torch.equal(on_device[name].cpu(), getattr(penalties, name)), name

    size = len(slots) + rng.randint(0, 2)
    index = torch.tensor(rng.sample(range(size), len(slots)))
    logits = torch.randn(size, V, generator=gen) * 3
    logits[torch.rand(size, V, generator=gen) < 0.1] = float("-inf")
    steps = [penalties.history.shape[1]] * len(slots)  # a bound on each row's entries, as the engine gives
    for slot, step in zip(slots, steps):
        penalties.counted[slot] = step  # its history is up to date: no rebuild
    want = logits.clone()
    penalties.apply(want, Rows(index, slot_ids, slots, [None] * len(slots), steps, None))
    got = logits.clone().to(DEVICE)
    triton_fused.triton_penalties(got, index.to(DEVICE), slot_ids.to(DEVICE), on_device["history"],
                                  on_device["count"], on_device["factors"], on_device["length"])
    assert not torch.equal(want, logits)  # the edit changed something
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_triton_logit_bias_and_min_p_are_the_torch_paths(seed):
    # Both kernels against logit_edits.py's torch paths: slots with more and fewer (token, bias) pairs than the
    # widest (token 0 biased in one, the padding's token), rows in another order than the slots beside rows
    # that use neither, -inf logits, each min_p floor its own.
    from types import SimpleNamespace

    from nanoserve.features.processors import Rows
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.features.logit_edits import LogitBias, MinP
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    V, M = rng.choice([50, 5000]), rng.randint(2, 6)
    bias, min_p = LogitBias(M, V, torch.device("cpu")), MinP(M, V, torch.device("cpu"))
    slots = rng.sample(range(M), rng.randint(2, M))
    for i, slot in enumerate(slots):
        pairs = {t: rng.uniform(-5, 5) for t in rng.sample(range(V), rng.randint(1, 40))} | ({0: 7.5} if i else {})
        seq = SimpleNamespace(params=SamplingParams(logit_bias=pairs, min_p=rng.uniform(0.01, 0.9),
                                                    temperature=rng.choice([0.5, 1.0, 1.3])))
        bias.add(slot, seq)
        min_p.add(slot, seq)
    size = len(slots) + rng.randint(0, 2)
    index, slot_ids = torch.tensor(rng.sample(range(size), len(slots))), torch.tensor(slots)
    logits = torch.randn(size, V, generator=gen) * 3
    logits[torch.rand(size, V, generator=gen) < 0.1] = float("-inf")
    want = logits.clone()
    rows = Rows(index, slot_ids, slots, [None] * len(slots), [0] * len(slots), None)
    bias.apply(want, rows)
    min_p.apply(want, rows)
    got = logits.clone().to(DEVICE)
    on = {name: t.to(DEVICE) for name, t in (("index", index), ("slots", slot_ids), ("ids", bias.ids),
                                             ("values", bias.values), ("sizes", bias.sizes), ("floor", min_p.floor))}
    triton_fused.triton_logit_bias(got, on["index"], on["slots"], on["ids"], on["values"], on["sizes"])
    triton_fused.triton_min_p(got, on["index"], on["slots"], on["floor"])
    assert (want == float("-inf")).sum() > (logits == float("-inf")).sum()  # min_p cut something
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_banning_kernels_edit_16_bit_logits_as_the_torch_paths_do(dtype):
    # A step whose processors only ban edits the model's own (bfloat16) logits: min_p's and the grammar mask's
    # kernels in any float dtype, against their torch paths in that dtype (-inf beside rows that use neither).
    from types import SimpleNamespace

    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.features.logit_edits import MinP
    from nanoserve.features.processors import Rows
    from nanoserve.features.structured_outputs import unpack_bitmask
    from nanoserve.kernels import triton_fused

    gen, V, M = torch.Generator().manual_seed(0), 3000, 4
    min_p = MinP(M, V, torch.device("cpu"))
    for slot in range(M):
        min_p.add(slot, SimpleNamespace(params=SamplingParams(min_p=0.1 + 0.2 * slot, temperature=0.8)))
    logits = (torch.randn(M + 1, V, generator=gen) * 3).to(dtype)
    logits[0, :10] = float("-inf")
    index, slots = torch.tensor([3, 0, 4, 1]), torch.arange(M)
    words = torch.randint(-2**31, 2**31 - 1, (M, (V + 31) // 32), dtype=torch.int32, generator=gen)
    want = logits.float()  # the torch paths, in float32 (exact: both only write -inf), then in the dtype
    min_p.apply(want, Rows(index, slots, slots.tolist(), [None] * M, [0] * M, None))
    for r, row in enumerate(index.tolist()):
        want[row].masked_fill_(~unpack_bitmask(words[r:r + 1], V)[0], float("-inf"))
    got, on = logits.to(DEVICE), lambda t: t.to(DEVICE)
    triton_fused.triton_min_p(got, on(index), on(slots), on(min_p.floor))
    triton_fused.triton_apply_bitmask(got, on(words), on(index))
    assert got.dtype == dtype and torch.equal(got.cpu(), want.to(dtype)) and (want[index] > float("-inf")).any()


@pytest.mark.parametrize("seed", range(4))
def test_triton_top_k_is_torch_topk(seed):
    # logprobs' top k: the values are torch.topk's exactly, each token holds its value, no token twice. Rows
    # of a few tiles and a ragged last one (small tiles here, the interpreter runs each program in Python),
    # logits rounded to quarters so that many tie (in a tile and across tiles), k from 1 to past a tile's width.
    from nanoserve.kernels import triton_fused

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, V, block = rng.randint(1, 4), rng.choice([37, 200, 1000]), rng.choice([16, 64])
    dtype = rng.choice([torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
    logits = ((torch.randn(B, V, generator=gen) * 8).round() / 4).to(DEVICE, dtype)
    for k in sorted({1, 2, rng.randint(3, 20), min(V, block + 3)}):
        values, tokens = triton_fused.triton_top_k(logits, k, block=block)
        want = logits.float().topk(k, dim=-1).values
        assert values.dtype == torch.float32 and tokens.shape == (B, k)
        assert torch.equal(values, want), k
        assert torch.equal(logits.float().gather(1, tokens), values), k
        assert all(len(set(row)) == k for row in tokens.tolist()) and int(tokens.max()) < V, k

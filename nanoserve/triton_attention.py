"""Triton kernels for attention over a paged KV cache: store K/V, decode (flash-decoding), prefill.

The paged layout. Per layer, k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A token's *slot* is block_id * block_size + offset, so slot s lives at k_cache.view(-1, kv_heads, D)[s].
A sequence's block_tables row lists its block ids in order (padded with -1); context_lens[b] counts
the tokens of sequence b whose K/V are in the cache, the new ones included (K/V are stored first).
Query head h reads kv head h // group, group = num_heads // num_kv_heads (grouped-query attention).

Every kernel has a plain-torch twin (`*_reference`) that computes the same thing slowly in fp32;
the tests compare the two. Read the reference first: it is the definition.
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E); exp2 is the GPU's native instruction


# ---------------------------------------------------------------------------------- references

def store_kv_reference(k_cache, v_cache, slot_mapping, k, v):
    """Write k[i], v[i] ([T, kv_heads, D]) into slot slot_mapping[i]; slots < 0 are padding, skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def _gather(cache, block_table, length):
    """The first `length` tokens of one sequence out of the paged cache: [length, kv_heads, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attention_fp32(q, k, v, positions, scale):
    """q [n, H, D] at `positions` attends causally to k, v [L, KV, D]; fp32 math, returns fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]  # [n, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """One new query per sequence: q [B, H, D] sees all context_lens[b] cached tokens."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k, v = _gather(k_cache, block_tables[b], n), _gather(v_cache, block_tables[b], n)
        out[b] = _attention_fp32(q[b : b + 1], k, v, torch.tensor([n - 1], device=q.device), scale)[0].to(q.dtype)
    return out


def paged_prefill_attention_reference(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale=None):
    """New tokens of B sequences, flat in q [T, H, D]; sequence b's last n_b tokens attend causally."""
    out = torch.empty_like(q)
    for b in range(len(context_lens)):
        start, end, n_ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(context_lens[b])
        k, v = _gather(k_cache, block_tables[b], n_ctx), _gather(v_cache, block_tables[b], n_ctx)
        positions = torch.arange(n_ctx - (end - start), n_ctx, device=q.device)
        out[start:end] = _attention_fp32(q[start:end], k, v, positions, scale).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------- store_kv

@triton.jit
def _store_kv_kernel(k_cache, v_cache, slot_mapping, k, v, stride_k, stride_v,
                     ROW: tl.constexpr, ROW_POW2: tl.constexpr):
    # One program per new token: copy its whole [kv_heads * D] row of K and of V into its slot.
    i = tl.program_id(0)
    slot = tl.load(slot_mapping + i).to(tl.int64)  # int64: slot * ROW can pass 2**31 in a big cache
    if slot < 0:  # slot -1 = a padding token (CUDA graphs run fixed-size batches): write nothing
        return
    cols = tl.arange(0, ROW_POW2)
    mask = cols < ROW
    tl.store(k_cache + slot * ROW + cols, tl.load(k + i * stride_k + cols, mask=mask), mask=mask)
    tl.store(v_cache + slot * ROW + cols, tl.load(v + i * stride_v + cols, mask=mask), mask=mask)


def _rows_contiguous(x):
    """x [T, heads, D] with each token's heads*D values packed together (a row stride is allowed)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def store_kv(k_cache, v_cache, slot_mapping, k, v):
    """Triton version of store_kv_reference. k, v: [T, kv_heads, D]; slot_mapping: [T] int32/int64."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k, v = _rows_contiguous(k), _rows_contiguous(v)  # the k, v halves of a fused qkv keep a row stride
    T, kv_heads, D = k.shape
    if T == 0:
        return
    row = kv_heads * D
    _store_kv_kernel[(T,)](k_cache, v_cache, slot_mapping, k, v, k.stride(0), v.stride(0),
                           ROW=row, ROW_POW2=triton.next_power_of_2(row))


# ---------------------------------------------------------------------------------- decode
#
# Flash-decoding. A decode step has one query per sequence, so attention is a matrix-vector product:
# its cost is reading K and V once. To read them at full bandwidth we need (a) every K/V byte read
# once, (b) enough programs to fill all 132 SMs and (c) wide, independent loads in flight.
#  (a) one program serves all `group` query heads of one kv head: each K/V tile is loaded once and
#      used by the whole group (a [GROUP_PAD, D] x [D, BLOCK_N] tl.dot on the tensor cores);
#  (b) grid = (kv_heads, batch, splits). At batch 256 there are 2048 programs already; at batch 1
#      there would be 8, so the context is cut into `splits` chunks handled by different programs
#      (split-K), each leaving a partial (max, sum, unnormalized acc) that a second kernel combines;
#  (c) each loop iteration gathers BLOCK_N tokens (several pages) through the block table.

@triton.jit
def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
                   qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, chunk,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
                   D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    kv_head, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens + b)
    start = split * chunk  # this program's tokens: [start, end)
    end = tl.minimum(start + chunk, context_len)

    g = tl.arange(0, GROUP_PAD)  # query heads of the group (rows >= GROUP are padding, never stored)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q_tile = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                     mask=g[:, None] < GROUP, other=0.0)  # [GROUP_PAD, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)            # running sum of exp2(score - m) * v

    table = block_tables + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        valid = tokens < end
        # token t sits in page t // BLOCK_SIZE at offset t % BLOCK_SIZE: look its block id up
        block_ids = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
        rows = slots * (KV_HEADS * D) + kv_head * D  # start of this token's head-D row
        k = tl.load(k_cache + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)

        if USE_DOT:  # tensor cores; the group is padded to 16 rows, the minimum a tl.dot takes
            s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION)
        else:        # CUDA cores: a broadcast multiply and a sum over D, no padding needed
            s = tl.sum(q_tile[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]

        # online softmax: rescale what we summed so far to the new max, then add this tile
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # the first tile: exp2(-inf) = 0 (every tile has a valid token)
        p = tl.exp2(s - m_new[:, None])
        l = l + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        m = m_new

    if NUM_SPLITS == 1:  # the whole context was ours: normalize and write the answer
        o = acc / l[:, None]
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out.dtype.element_ty), mask=g[:, None] < GROUP)
    else:  # write the partial result; a split past the end leaves m = -inf, l = 0, acc = 0
        idx = (b * (KV_HEADS * GROUP) + heads) * NUM_SPLITS + split  # [B, H, NUM_SPLITS] order
        tl.store(part_acc + idx[:, None] * D + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(part_ml + idx * 2, m, mask=g < GROUP)
        tl.store(part_ml + idx * 2 + 1, l, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(part_acc, part_ml, out, stride_ob, stride_oh, NUM_HEADS: tl.constexpr,
                          D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr):
    # One program per (sequence, head): combine the splits' partial softmaxes.
    # Split i saw sum_i = sum exp2(s - m_i) and acc_i = sum exp2(s - m_i) v. Rescaled to the global
    # max M, the full softmax is sum_i exp2(m_i - M) acc_i / sum_i exp2(m_i - M) sum_i.
    h, b = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, D)
    base = (b * NUM_HEADS + h) * NUM_SPLITS + i
    m = tl.load(part_ml + base * 2, mask=i < NUM_SPLITS, other=float("-inf"))
    l = tl.load(part_ml + base * 2 + 1, mask=i < NUM_SPLITS, other=0.0)
    acc = tl.load(part_acc + base[:, None] * D + d[None, :], mask=(i < NUM_SPLITS)[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # empty splits: exp2(-inf) = 0
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out + b * stride_ob + h * stride_oh + d, o.to(out.dtype.element_ty))


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on a CPU: pretend to be an H100/H200 so the same splits are tested


def decode_num_splits(batch, kv_heads, max_context_len, device, block_n=64, min_tokens_per_split=256):
    """How many programs share one sequence's context: enough for ~4 programs per SM, none below
    min_tokens_per_split tokens (a split that reads little spends its time on setup and the reduce)."""
    programs = batch * kv_heads
    wanted = triton.cdiv(4 * _num_sms(device), programs)
    most = triton.cdiv(max_context_len, max(min_tokens_per_split, block_n))
    return max(1, min(wanted, most, 64))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, *,
                           max_context_len=None, num_splits=None, block_n=None, num_warps=None,
                           num_stages=None, use_dot=True):
    """Decode attention over the paged cache; same arguments and result as the reference.

    max_context_len: max(context_lens), if the caller knows it (saves a GPU->CPU sync).
    The rest are tuning knobs for bench/attention_kernels.py; None picks the defaults.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, num_heads, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and D == triton.next_power_of_2(D)
    group = num_heads // kv_heads
    scale = D**-0.5 if scale is None else scale
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_n = block_n or 64
    if num_splits is None:
        num_splits = decode_num_splits(B, kv_heads, max_context_len, q.device, block_n)
    # each split's chunk is a whole number of BLOCK_N tiles
    chunk = triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context_len, chunk)

    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(B, num_heads, num_splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(kv_heads, B, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), chunk,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group),
        KV_HEADS=kv_heads, D=D, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        USE_DOT=use_dot, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or 4, num_stages=num_stages or 2)
    if num_splits > 1:
        _decode_reduce_kernel[(num_heads, B)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, D=D,
            NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits), num_warps=4)
    return out


# ---------------------------------------------------------------------------------- prefill
#
# FlashAttention over the paged cache. A program takes BLOCK_M new tokens of one sequence for one
# query head, and walks over that sequence's keys BLOCK_N at a time with an online softmax, so the
# [n, L] score matrix is never written out. Keys come through the block table, like in decode.
# The new tokens are the last n of context_len, so token i (0-based among the new) sits at
# position context_len - n + i and sees keys 0 .. that position (a cached prefix included).

@triton.jit
def _prefill_kernel(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, num_m_tiles,
                    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    # Heads vary fastest in the grid, so the `group` programs that share a kv head run side by side
    # and read the same K/V from L2. Tiles run last-first: the last tiles see the most keys, and
    # starting the longest work first leaves less of a tail when the grid drains.
    h, b = tl.program_id(0), tl.program_id(2)
    tile = num_m_tiles - 1 - tl.program_id(1)
    q_start = tl.load(cu_seqlens_q + b)
    n_new = tl.load(cu_seqlens_q + b + 1) - q_start
    if tile * BLOCK_M >= n_new:  # the grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens + b)
    kv_head = h // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    row_ok = rows < n_new
    q_pos = context_len - n_new + rows              # position in the sequence
    d = tl.arange(0, D)
    q_tile = tl.load(q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                     mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    table = block_tables + b * stride_bt
    kv_end = tl.minimum(context_len, context_len - n_new + (tile + 1) * BLOCK_M)  # last row's pos + 1
    for n0 in range(0, kv_end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_rows = slots * (KV_HEADS * D) + kv_head * D
        k = tl.load(k_cache + kv_rows[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_cache + kv_rows[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)

        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # causal mask; it also hides keys >= kv_end for every real row (their q_pos < kv_end)
        s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
        # key 0 is in the first tile and every row sees it, so m is finite from the first tile on
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    o = acc / l[:, None]
    tl.store(out + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale=None, *,
                            max_query_len=None, block_m=None, block_n=None, num_warps=None, num_stages=None):
    """Prefill attention over the paged cache; same arguments and result as the reference.

    max_query_len: max over b of cu_seqlens_q[b+1] - cu_seqlens_q[b], if known (saves a sync).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    T, num_heads, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and D == triton.next_power_of_2(D)
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    B = len(context_lens)
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m, block_n = block_m or 128, block_n or 64
    num_m_tiles = triton.cdiv(max_query_len, block_m)
    _prefill_kernel[(num_heads, num_m_tiles, B)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_m_tiles,
        GROUP=num_heads // kv_heads, KV_HEADS=kv_heads, D=D, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or 8, num_stages=num_stages or 3)
    return out

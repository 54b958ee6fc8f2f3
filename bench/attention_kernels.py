"""Speed of the Triton paged-attention kernels on a GPU, against PyTorch's SDPA (cuDNN and flash).

Run on a CUDA machine:  python bench/attention_kernels.py --out results.json [--sweep]

Shapes are Qwen3-0.6B's: 16 query heads, 8 kv heads, head_dim 128, bf16, 16-token blocks with
shuffled block ids. Every shape is first checked against the fp32 reference (atol 2e-2).

Decode reads each cached K and V byte once, so its score is effective bandwidth:
bytes = 2 (K and V) * batch * context * kv_heads * head_dim * 2 bytes, over the time. SDPA runs the
same math on a contiguous cache [batch, kv_heads, context, head_dim] (what a paged cache saves us).
Prefill is matrix work: FLOPs = 4 * heads * head_dim * sum over sequences of n_new * (average keys
seen), i.e. causal work only. Times: CUDA events around each call, L2 flushed before each one,
median of 50 after warm-up. --sweep also times other block sizes, warps, stages and split counts.
"""
import argparse
import json
import statistics
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from nanoserve.kernels import paged as reference  # the torch CPU path: the definition
from nanoserve.kernels import triton_paged as ta

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
ATOL = 2e-2
DEVICE = "cuda"

_flush = None  # a buffer larger than the 60 MB L2, overwritten before each timed call


def time_us(fn, iters=50, warmup=5):
    """Median time of fn() in microseconds, each call measured with CUDA events, L2 flushed first."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 * 2**20, dtype=torch.int32, device=DEVICE)  # 1 GiB
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        _flush.zero_()  # also gives the CPU time to queue fn's launches before the GPU reaches them
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000


def paged_cache(lengths, gen):
    """Random K/V for sequences of `lengths` in a paged cache with shuffled block ids."""
    pages = [triton.cdiv(n, BLOCK_SIZE) for n in lengths]
    ids = torch.randperm(sum(pages), generator=gen).int()
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        tables[b, :p] = ids[used:used + p]
        used += p
    shape = (sum(pages), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, tables.to(DEVICE), lens


def contiguous(cache, tables, length):
    """The same K or V as SDPA wants it: [batch, kv_heads, length, head_dim] (all sequences `length` long)."""
    return cache[tables.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()


def sdpa_time(q, k, v, backend, **kwargs):
    """Time SDPA on one backend; GQA natively (enable_gqa) if the backend takes it, else kv heads repeated."""
    for how in ("enable_gqa", "kv heads repeated"):
        try:
            if how == "enable_gqa":
                args = dict(enable_gqa=True)
                kk, vv = k, v
            else:
                args = {}
                kk, vv = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, **args, **kwargs)
            out = call()
            return {"us": time_us(call), "gqa": how}, out
        except Exception as e:  # noqa: BLE001 -- a backend that refuses the shape is a result too
            error = f"{type(e).__name__}: {str(e)[:200]}"
    return {"error": error}, None


def check(out, ref):
    err = (out.float() - ref.float()).abs().max().item()
    return {"max_abs_err": err, "pass": bool(err <= ATOL)}


# ---------------------------------------------------------------------------------- decode

DECODE_SWEEP = [dict(block_n=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]


def bench_decode(batch, ctx, sweep, gen):
    k_cache, v_cache, tables, lens = paged_cache([ctx] * batch, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    gbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / 1e9
    tbps = lambda us: gbytes / us * 1e3  # noqa: E731  GB / µs = 1000 TB/s
    row = {"batch": batch, "context": ctx, "GB_read": gbytes,
           "num_splits": ta.decode_num_splits(batch, KV_HEADS, ctx, q.device)}

    ours = lambda **kw: ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, max_context_len=ctx, **kw)  # noqa: E731
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    row["check"] = check(ours(), ref)
    row["ours_us"] = time_us(ours)
    row["ours_TBps"] = tbps(row["ours_us"])

    k, v = contiguous(k_cache, tables, ctx), contiguous(v_cache, tables, ctx)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        result, out = sdpa_time(q[:, :, None], k, v, backend)
        if out is not None:
            result["TBps"] = tbps(result["us"])
            result["check"] = check(out[:, :, 0], ref)
        row["sdpa_" + name] = result
    if "us" in row["sdpa_cudnn"]:
        row["ours_vs_cudnn"] = row["sdpa_cudnn"]["us"] / row["ours_us"]  # > 1: ours is faster

    if sweep:
        configs = list(DECODE_SWEEP) if batch * KV_HEADS >= 1024 else []
        configs += [dict(num_splits=s) for s in (1, 2, 4, 8, 16, 32, 64) if s * 64 <= ctx]
        configs += [dict(num_splits=s, block_n=n) for s in (8, 16, 32) for n in (32, 128) if s * n <= ctx
                    and batch * KV_HEADS < 1024]
        row["sweep"] = []
        for cfg in configs:
            try:
                us = time_us(lambda: ours(**cfg), iters=20, warmup=2)
                row["sweep"].append({**cfg, "us": us, "TBps": tbps(us)})
            except Exception as e:  # noqa: BLE001 -- e.g. out of shared memory: record and go on
                row["sweep"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        done = [r for r in row["sweep"] if "us" in r]
        row["sweep_best"] = min(done, key=lambda r: r["us"]) if done else None
    return row


# ---------------------------------------------------------------------------------- prefill

PREFILL_SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in
                 [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                  (64, 128, 4, 2), (128, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2)]]


def bench_prefill(num_seqs, n_new, prefix, sweep, gen):
    ctx = prefix + n_new
    k_cache, v_cache, tables, lens = paged_cache([ctx] * num_seqs, gen)
    q = torch.randn(num_seqs * n_new, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * n_new
    flops = 4 * HEADS * HEAD_DIM * num_seqs * n_new * (prefix + (n_new + 1) / 2)
    tflops = lambda us: flops / us * 1e-6  # noqa: E731
    row = {"seqs": num_seqs, "new_tokens": n_new, "cached_prefix": prefix, "GFLOP": flops / 1e9}

    ours = lambda **kw: ta.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max_query_len=n_new, **kw)  # noqa: E731
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables)
    row["check"] = check(ours(), ref)
    row["ours_us"] = time_us(ours)
    row["ours_TFLOPs"] = tflops(row["ours_us"])

    k, v = contiguous(k_cache, tables, ctx), contiguous(v_cache, tables, ctx)
    qs = q.view(num_seqs, n_new, HEADS, HEAD_DIM).transpose(1, 2)
    # is_causal aligns the mask top-left; with a cached prefix the new tokens are the *last* rows
    causal = dict(is_causal=True) if prefix == 0 else dict(attn_mask=causal_lower_right(n_new, ctx))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        result, out = sdpa_time(qs, k, v, backend, **causal)
        if out is not None:
            result["TFLOPs"] = tflops(result["us"])
            result["check"] = check(out.transpose(1, 2).reshape_as(q), ref)
        row["sdpa_" + name] = result
    if "us" in row["sdpa_cudnn"]:
        row["ours_vs_cudnn"] = row["sdpa_cudnn"]["us"] / row["ours_us"]

    if sweep:
        row["sweep"] = []
        for cfg in PREFILL_SWEEP:
            try:
                us = time_us(lambda: ours(**cfg), iters=20, warmup=2)
                row["sweep"].append({**cfg, "us": us, "TFLOPs": tflops(us)})
            except Exception as e:  # noqa: BLE001
                row["sweep"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        done = [r for r in row["sweep"] if "us" in r]
        row["sweep_best"] = min(done, key=lambda r: r["us"]) if done else None
    return row


def copy_bandwidth():
    """The memory ceiling: a 2 GiB device-to-device copy, bytes read plus bytes written."""
    src = torch.randn(2**29, device=DEVICE)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=20)
    return 2 * src.nbytes / 1e9 / us * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this script needs a CUDA GPU"
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                        "dtype": "bfloat16"},
              "decode": [], "prefill": [], "errors": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["copy_TBps"] = copy_bandwidth()
    for batch, ctx in ((256, 1024), (1, 4096), (64, 2048)):
        try:
            result["decode"].append(bench_decode(batch, ctx, args.sweep, gen))
        except Exception:  # noqa: BLE001 -- keep the other shapes' numbers
            result["errors"].append(f"decode {batch}x{ctx}: {traceback.format_exc()[-1500:]}")
        save()
    for seqs, n_new, prefix in ((8, 1024, 0), (8, 512, 512)):
        try:
            result["prefill"].append(bench_prefill(seqs, n_new, prefix, args.sweep, gen))
        except Exception:  # noqa: BLE001
            result["errors"].append(f"prefill {seqs}x{n_new}+{prefix}: {traceback.format_exc()[-1500:]}")
        save()

    # the table, last, so it ends the log
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}; "
          f"device copy {result['copy_TBps']:.2f} TB/s")
    fmt = lambda r, key: f"{r[key]:7.2f}" if key in r else "    n/a"  # noqa: E731
    print("decode (batch x ctx)   ours us  TB/s  ok | cudnn us  TB/s | flash us  TB/s | ours/cudnn speed")
    for r in result["decode"]:
        c, f = r["sdpa_cudnn"], r["sdpa_flash"]
        print(f"  {r['batch']:4d} x {r['context']:5d}  {r['ours_us']:8.1f} {r['ours_TBps']:5.2f} {r['check']['pass']!s:>5} |"
              f" {c.get('us', float('nan')):8.1f} {c.get('TBps', float('nan')):5.2f} |"
              f" {f.get('us', float('nan')):8.1f} {f.get('TBps', float('nan')):5.2f} | {r.get('ours_vs_cudnn', float('nan')):.2f}")
        if r.get("sweep_best"):
            print(f"      sweep best: {r['sweep_best']}")
    print("prefill (seqs x new + prefix)  ours us TFLOP/s ok | cudnn us TFLOP/s | flash us TFLOP/s")
    for r in result["prefill"]:
        c, f = r["sdpa_cudnn"], r["sdpa_flash"]
        print(f"  {r['seqs']} x {r['new_tokens']:4d} + {r['cached_prefix']:4d}   {r['ours_us']:8.1f} {fmt(r, 'ours_TFLOPs')}"
              f" {r['check']['pass']!s:>5} | {c.get('us', float('nan')):8.1f} {fmt(c, 'TFLOPs')} |"
              f" {f.get('us', float('nan')):8.1f} {fmt(f, 'TFLOPs')}")
        if r.get("sweep_best"):
            print(f"      sweep best: {r['sweep_best']}")
    for e in result["errors"]:
        print("ERROR", e)
    save()


if __name__ == "__main__":
    main()

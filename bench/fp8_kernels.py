"""The fp8 KV cache, kernel by kernel: the Triton decode and prefill kernels over a bf16 cache and over
an fp8 (e4m3) cache of the same values, Qwen3-0.6B's heads, at the workload's sizes; for decode also a sweep
of the product's dtype (float16 or bfloat16), tiles, warps and stages over the fp8 cache (the defaults were
tuned for bf16, whose tiles are twice the bytes). Each fp8 result is checked against the torch reference over the same fp8 cache.

    python bench/fp8_kernels.py OUT.json        (a CUDA machine)
"""
import json
import sys

import torch

from attention_kernels import DEVICE, HEAD_DIM, HEADS, KV_HEADS, check, paged_cache, time_us
from nanoserve.kernels import paged as reference
from nanoserve.kernels import triton_paged as ta

FP8 = torch.float8_e4m3fn
SWEEP = [dict(fp16_mma=f, block_n=n, num_warps=w, num_stages=s) for f in (False, True) for n in (64, 128, 256)
         for w in (4, 8) for s in (2, 3)]
SMALL_SWEEP = [dict(fp16_mma=f, block_n=n) for f in (False, True) for n in (64, 128)]


def decode_row(batch, ctx, gen, sweep):
    k16, v16, tables, lens = paged_cache([ctx] * batch, gen)
    k8, v8 = reference.to_cache_dtype(k16, FP8), reference.to_cache_dtype(v16, FP8)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    row = {"batch": batch, "context": ctx}
    for name, (k, v) in {"bf16": (k16, v16), "fp8": (k8, v8)}.items():
        gbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * k.dtype.itemsize / 1e9
        call = lambda **kw: ta.paged_decode_attention(q, k, v, tables, lens, max_context_len=ctx, **kw)  # noqa: E731
        row[name] = {"check": check(call(), reference.paged_decode_attention(q, k, v, tables, lens)),
                     "us": time_us(call), "GB_read": gbytes}
        row[name]["TBps"] = gbytes / row[name]["us"] * 1e3
        if name == "fp8":
            found = []
            for cfg in sweep:
                try:
                    us = time_us(lambda: call(**cfg), iters=20, warmup=2)
                    found.append({**cfg, "us": us})
                except Exception as e:  # noqa: BLE001 -- e.g. out of shared memory: a result too
                    found.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:100]}"})
            row["fp8_sweep"] = found
            row["fp8_best"] = min((r for r in found if "us" in r), key=lambda r: r["us"], default=None)
            row["fp8_best_bf16_mma"] = min((r for r in found if "us" in r and not r["fp16_mma"]),
                                           key=lambda r: r["us"], default=None)
    row["fp8_over_bf16_time"] = row["fp8"]["us"] / row["bf16"]["us"]
    return row


def prefill_row(num_seqs, n_new, gen):
    k16, v16, tables, lens = paged_cache([n_new] * num_seqs, gen)
    k8, v8 = reference.to_cache_dtype(k16, FP8), reference.to_cache_dtype(v16, FP8)
    q = torch.randn(num_seqs * n_new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * n_new
    row = {"seqs": num_seqs, "new_tokens": n_new}
    for name, (k, v) in {"bf16": (k16, v16), "fp8": (k8, v8)}.items():
        call = lambda **kw: ta.paged_prefill_attention(q, k, v, cu, lens, tables, max_query_len=n_new, **kw)  # noqa: E731
        row[name] = {"check": check(call(), reference.paged_prefill_attention(q, k, v, cu, lens, tables)),
                     "us": time_us(call)}
        if name == "fp8":
            row["fp8_bf16_mma"] = {"check": check(call(fp16_mma=False), reference.paged_prefill_attention(
                q, k, v, cu, lens, tables)), "us": time_us(lambda: call(fp16_mma=False))}
    return row


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "decode": [], "prefill": []}
    for batch, ctx in ((256, 1024), (128, 2048), (32, 1024), (1, 1024), (1, 4096)):
        result["decode"].append(decode_row(batch, ctx, gen, SWEEP if batch == 256 else SMALL_SWEEP))
        r = result["decode"][-1]
        print(f"decode {batch}x{ctx}: bf16 {r['bf16']['us']:.0f} us ({r['bf16']['TBps']:.2f} TB/s), fp8 "
              f"{r['fp8']['us']:.0f} us ({r['fp8']['TBps']:.2f} TB/s), best fp8 {r['fp8_best']}, best with bf16 "
              f"products {r['fp8_best_bf16_mma']}", flush=True)
    for num_seqs, n_new in ((8, 1024), (16, 1024)):
        result["prefill"].append(prefill_row(num_seqs, n_new, gen))
        r = result["prefill"][-1]
        print(f"prefill {num_seqs}x{n_new}: bf16 {r['bf16']['us']:.0f} us, fp8 {r['fp8']['us']:.0f} us "
              f"(bf16 products: {r['fp8_bf16_mma']['us']:.0f} us)", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prefill kernel's tiles swept on a GPU, against cuDNN's SDPA (the goal: the prefill kernel >= 0.9x cuDNN
on 8 x 1,024), in bf16 on Qwen3-0.6B's shapes: rows per program (tokens x heads), keys per tile, warps, stages,
and one query head or the whole group of a kv head per program (pack). Each config is checked against the
default's output first. Times: bench/attention_kernels.py's (CUDA events, L2 flushed, median).

    python bench/prefill_sweep.py OUT.json

The first run (bench/results/kernels/h200_prefill_sweep.json) swept a prototype of today's kernel against
the kernel before it ("current_us"): the causal mask only on the tiles that cross the diagonal, and pack.
"""
import itertools
import json
import sys

import torch
import triton

from nanoserve.kernels import triton_paged as ta


def case(lengths_new, prefixes, heads, kv_heads, D, dtype, device, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = [n + p for n, p in zip(lengths_new, prefixes)]
    pages = [triton.cdiv(c, block_size) for c in ctx]
    ids = torch.randperm(sum(pages) + 3, generator=gen)[:sum(pages)].int()
    tables = torch.full((len(ctx), max(pages)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        tables[b, :n] = ids[at:at + n]
        at += n
    nb = sum(pages) + 3
    k = torch.randn(nb, block_size, kv_heads, D, generator=gen).to(dtype)
    v = torch.randn(nb, block_size, kv_heads, D, generator=gen).to(dtype)
    q = torch.randn(sum(lengths_new), heads, D, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths_new)), dtype=torch.int32)
    cl = torch.tensor(ctx, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, cu, cl, tables)]


def sweep(path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sys.path.insert(0, "bench")
    from attention_kernels import time_us

    H, KVH, D = 16, 8, 128
    shapes = {"8x1024": ([1024] * 8, [0] * 8), "8x512+512": ([512] * 8, [512] * 8),
              "workload-like 31 seqs": ([507] * 30 + [495], [0] * 31), "2x4096": ([4096] * 2, [0] * 2)}
    results = {"device": torch.cuda.get_device_name(), "rows": []}
    for name, (lengths, prefixes) in shapes.items():
        q, k, v, cu, cl, bt = case(lengths, prefixes, H, KVH, D, torch.bfloat16, "cuda")
        mql = max(lengths)
        want = ta.paged_prefill_attention(q, k, v, cu, cl, bt, max_query_len=mql)
        row = {"shape": name, "default_us": time_us(lambda: ta.paged_prefill_attention(q, k, v, cu, cl, bt,
                                                                                          max_query_len=mql))}
        # cuDNN on contiguous [B, H, L, D] (equal lengths only), as bench/attention_kernels.py
        if len(set(lengths)) == 1 and len(set(prefixes)) == 1:
            B, L, P = len(lengths), lengths[0], prefixes[0]
            kk = torch.randn(B, KVH, L + P, D, device="cuda", dtype=torch.bfloat16)
            vv = torch.randn_like(kk)
            qq = q.view(B, L, H, D).transpose(1, 2)
            mask = causal_lower_right(L, L + P)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                                              enable_gqa=True)
                try:
                    row["cudnn_us"] = time_us(fn)
                except Exception as e:
                    row["cudnn_error"] = repr(e)[:200]
        configs = []
        for bm, bn, w, st, pack in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (False, True)):
            knobs = dict(max_query_len=mql, block_m=bm, block_n=bn, num_warps=w, num_stages=st, pack=pack)
            try:
                got = ta.paged_prefill_attention(q, k, v, cu, cl, bt, **knobs)
                err = (got.float() - want.float()).abs().max().item()
                us = time_us(lambda: ta.paged_prefill_attention(q, k, v, cu, cl, bt, **knobs), iters=20)
                configs.append({"block_m": bm, "block_n": bn, "warps": w, "stages": st, "pack": pack, "us": us,
                                "err": err})
            except Exception as e:
                configs.append({"block_m": bm, "block_n": bn, "warps": w, "stages": st, "pack": pack,
                                "error": repr(e)[:120]})
        ok = sorted((c for c in configs if "us" in c and c["err"] < 0.05), key=lambda c: c["us"])
        row["best"] = ok[:8]
        row["all"] = configs
        print(name, {k: v for k, v in row.items() if k not in ("all",)}, flush=True)
        results["rows"].append(row)
    json.dump(results, open(path, "w"), indent=1)


if __name__ == "__main__":
    sweep(sys.argv[1])

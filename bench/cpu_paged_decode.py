"""On a CPU: lesson 03's torch decode attention (the gathered blocks through torch's fused attention) against
the gathered blocks through lesson 02's decode_attention, which it replaced, on SmolLM2-135M's head shapes.

    python bench/cpu_paged_decode.py
"""
import time

import torch

from nanoserve.kernels import paged
from nanoserve.kernels.contiguous import decode_attention


def through_lesson_02(q, k_cache, v_cache, tables, lens):
    blocks = tables[:, : -(-int(lens.max()) // k_cache.shape[1])].clamp(min=0).long().flatten()
    shape = (len(tables), -1, *k_cache.shape[2:])
    return decode_attention(q, k_cache.index_select(0, blocks).view(shape), v_cache.index_select(0, blocks).view(shape),
                            lens)


def main():
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    for batch, context in [(1, 100), (1, 700), (16, 100)]:
        per_seq = -(-context // block_size)
        k_cache = torch.randn(batch * per_seq + 4, block_size, kv_heads, head_dim)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(len(k_cache))[:batch * per_seq].view(batch, per_seq).int()
        lens = torch.tensor([context - 3 * i for i in range(batch)], dtype=torch.int32)
        q = torch.randn(batch, heads, head_dim)
        fns = {"lesson 02's decode_attention": lambda: through_lesson_02(q, k_cache, v_cache, tables, lens),
               "torch's fused attention": lambda: paged.paged_decode_attention(q, k_cache, v_cache, tables, lens)}
        us = {}
        for name, fn in fns.items():
            for _ in range(20):
                fn()
            start = time.perf_counter()
            for _ in range(500):
                fn()
            us[name] = (time.perf_counter() - start) / 500 * 1e6
        diff = (fns["lesson 02's decode_attention"]() - fns["torch's fused attention"]()).abs().max().item()
        print(f"{batch} x {context}: " + ", ".join(f"{name} {t:.0f} us" for name, t in us.items()) + f"; max diff {diff:.1e}")


if __name__ == "__main__":
    main()

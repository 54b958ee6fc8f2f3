"""Batch-1 matrix products as a decode step really runs them: 28 layers' distinct weights in
turn, so nothing stays in the 50 MB L2, inside one CUDA graph. cuBLAS (torch's F.linear) against a Triton
matrix-vector kernel over a sweep of its tiles; and the decode attention's number of splits at batch 1.
GPU only.

    python bench/gemv.py OUT.json            the sweep of tiles, the attention's splits
    python bench/gemv.py OUT.json --wide     more tiles (one row a program, 1024 columns, 8 warps, stages),
                                                 and gate/up with SiLU in the same kernel
"""
import json
import sys

import torch
import triton
import triton.language as tl

from nanoserve.kernels import triton_paged
from nanoserve.kernels.triton_fused import _gemv_kernel  # launched here with each tile of the sweep

sys.path.insert(0, "bench")
from step_floor import graph_time_ms  # noqa: E402

LAYERS = 28
WIDE = "--wide" in sys.argv
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # Qwen3-0.6B


def graph_ms(fn, rounds: int = 7) -> float:
    """Median ms of one replay of fn() recorded in a CUDA graph."""
    return graph_time_ms(fn, reps=1, rounds=rounds)


def gemv(x, w, y, block_n, block_k, warps, stages=None):
    N, K = w.shape
    extra = {} if stages is None else {"num_stages": stages}
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K=K, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                             **extra)
    return y


@triton.jit
def _gate_up_silu_kernel(x, w, y, I, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """SiLU(x @ W[:I].T) * (x @ W[I:].T): W is gate and up stacked, [2I, K]; y [I]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + cols).to(tl.float32)[None, :]
        gate += tl.load(w + rows[:, None] * K + cols[None, :], mask=rows[:, None] < I, other=0.0).to(tl.float32) * xv
        up += tl.load(w + (rows[:, None] + I) * K + cols[None, :], mask=rows[:, None] < I, other=0.0).to(tl.float32) * xv
    g = tl.sum(gate, axis=1).to(y.dtype.element_ty).to(tl.float32)
    u = tl.sum(up, axis=1).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + rows, (g / (1 + tl.exp(-g)) * u).to(y.dtype.element_ty), mask=rows < I)


def main() -> int:
    out = {"gpu": torch.cuda.get_device_name(), "layers": LAYERS, "shapes": SHAPES}
    weights = {name: [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
               for name, (N, K) in SHAPES.items()}
    xs = {name: torch.randn(1, K, device="cuda", dtype=torch.bfloat16) for name, (N, K) in SHAPES.items()}
    x8 = {name: torch.randn(8, K, device="cuda", dtype=torch.bfloat16) for name, (N, K) in SHAPES.items()}
    ys = {name: torch.empty(N, device="cuda", dtype=torch.bfloat16) for name, (N, K) in SHAPES.items()}
    ideal = {name: LAYERS * N * K * 2 / 4.3e12 * 1e3 for name, (N, K) in SHAPES.items()}
    for name in SHAPES:
        ws, x = weights[name], xs[name]
        row = {"ideal_ms_at_4.3TBps": ideal[name],
               "cublas_m1_ms": graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws]),
               "cublas_m8_ms": graph_ms(lambda: [torch.nn.functional.linear(x8[name], w) for w in ws])}
        ref = torch.nn.functional.linear(x, ws[0])[0].float()
        sweep = []
        tiles = ([(n, k, wp, st) for n in (1, 2, 4) for k in (512, 1024) for wp in (4, 8) for st in (None, 3)]
                 if WIDE else [(n, k, wp, None) for n in (2, 4, 8, 16) for k in (128, 256, 512) for wp in (2, 4)])
        for block_n, block_k, warps, stages in tiles:
            if block_k > SHAPES[name][1] or block_n * block_k > 16384 or block_n * block_k < 32 * warps:
                continue
            y = ys[name]
            gemv(x[0], ws[0], y, block_n, block_k, warps, stages)
            err = (y.float() - ref).abs().max().item()
            ms = graph_ms(lambda: [gemv(x[0], w, y, block_n, block_k, warps, stages) for w in ws], rounds=3)
            sweep.append((ms, block_n, block_k, warps, stages, err))
        sweep.sort()
        row["triton_best"] = sweep[:5]
        row["speedup_vs_cublas_m1"] = row["cublas_m1_ms"] / sweep[0][0]
        out[name] = row
        print(name, json.dumps(row), flush=True)
    total = {k: sum(out[n][k] for n in SHAPES) for k in ("ideal_ms_at_4.3TBps", "cublas_m1_ms", "cublas_m8_ms")}
    total["triton_best_ms"] = sum(out[n]["triton_best"][0][0] for n in SHAPES)
    out["total_per_forward"] = total
    print("per forward (28 layers, 4 products):", json.dumps(total), flush=True)
    if WIDE:  # gate/up and SiLU in one kernel, against the best gate_up product followed by torch's SiLU * up
        I, K = SHAPES["gate_up"][0] // 2, SHAPES["gate_up"][1]
        ws, x, y = weights["gate_up"], xs["gate_up"], torch.empty(I, device="cuda", dtype=torch.bfloat16)
        ms, bn, bk, wp, st, _ = out["gate_up"]["triton_best"][0]
        full = torch.empty(2 * I, device="cuda", dtype=torch.bfloat16)

        def separate():
            for w in ws:
                gemv(x[0], w, full, bn, bk, wp, st)
                g, u = full.chunk(2)
                torch.nn.functional.silu(g) * u
        fused = {}
        for block_n in (1, 2, 4):
            for warps in (2, 4, 8):
                f = (lambda block_n=block_n, warps=warps: [
                    _gate_up_silu_kernel[(triton.cdiv(I, block_n),)](x[0], w, y, I, K=K, BLOCK_N=block_n, BLOCK_K=512,
                                                                     num_warps=warps) for w in ws])
                fused[f"bn{block_n}_w{warps}"] = graph_ms(f, rounds=3)
        g, u = torch.nn.functional.linear(x, ws[0])[0].chunk(2)
        _gate_up_silu_kernel[(triton.cdiv(I, 2),)](x[0], ws[0], y, I, K=K, BLOCK_N=2, BLOCK_K=512, num_warps=4)
        out["gate_up_silu"] = {"separate_ms": graph_ms(separate, rounds=3), "fused_ms": fused,
                               "max_err": (y.float() - (torch.nn.functional.silu(g) * u).float()).abs().max().item()}
        print("gate_up + silu", json.dumps(out["gate_up_silu"]), flush=True)

    if WIDE:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        return 0
    # Decode attention at batch 1, context 640 (the batch-1 bench's middle), each number of splits.
    kv_heads, heads, D, block = 8, 16, 128, 16
    blocks = 4096 // block
    k_caches = [torch.randn(blocks, block, kv_heads, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_caches = [torch.randn_like(k) for k in k_caches]
    q = torch.randn(1, heads, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
    attention = {}
    for ctx in (128, 640, 2048):
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        for splits in (1, 2, 4, 8, 16, 32):
            attention[f"ctx{ctx}_splits{splits}"] = graph_ms(lambda: [
                triton_paged.paged_decode_attention(q, k, v, table, lens, max_context_len=4096, num_splits=splits)
                for k, v in zip(k_caches, v_caches)])
    out["decode_attention_28_layers_ms"] = attention
    print("attention", json.dumps(attention), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

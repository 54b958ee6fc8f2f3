"""Does the order of a decode batch's sequences change the decode kernel's speed?

The workload's decode steps mix contexts of 100 to 2,000 tokens; with one split per sequence a program
that starts a long context late leaves the GPU's other SMs idle at the end. This times the Triton decode
kernel on the workload's real context lengths at a few of its decode steps, with the sequences in the
scheduler's order, longest first and shortest first, and with 1, 2 and 4 splits. GPU only.

    python bench/decode_order.py OUT.json
"""
import json
import sys

import torch

from nanoserve.bench import workload
from nanoserve.kernels.triton_paged import paged_decode_attention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from step_floor import graph_time_ms  # noqa: E402


def main() -> int:
    out = sys.argv[1]
    torch.manual_seed(0)
    heads, kv_heads, D, block_size = 16, 8, 128, 16
    prompts, max_tokens = workload()
    results = []
    for step in (50, 200, 400, 700):
        lens = [len(p) + step for p, m in zip(prompts, max_tokens) if m > step]
        blocks = [-(-n // block_size) for n in lens]
        k_cache = torch.randn(sum(blocks) + 1, block_size, kv_heads, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        ids = torch.randperm(sum(blocks), device="cuda").int()
        width = max(blocks)
        tables = torch.full((len(lens), width), -1, dtype=torch.int32, device="cuda")
        first = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = ids[first:first + n]
            first += n
        context = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), heads, D, dtype=torch.bfloat16, device="cuda")
        gb = sum(lens) * kv_heads * D * 2 * 2 / 1e9
        row = {"step": step, "batch": len(lens), "GB": gb, "mean_context": sum(lens) / len(lens), "us": {}}
        orders = {"scheduler": torch.arange(len(lens), device="cuda"),
                  "longest first": context.argsort(descending=True), "shortest first": context.argsort()}
        want = paged_decode_attention(q, k_cache, v_cache, tables, context, max_context_len=4096)
        for name, order in orders.items():
            for splits in (1, 2, 4):
                qo, to, co = q[order].contiguous(), tables[order].contiguous(), context[order].contiguous()
                got = paged_decode_attention(qo, k_cache, v_cache, to, co, max_context_len=4096, num_splits=splits)
                err = (got.float() - want[order].float()).abs().max().item()
                ms = graph_time_ms(lambda: paged_decode_attention(qo, k_cache, v_cache, to, co, max_context_len=4096,
                                                                  num_splits=splits))
                row["us"][f"{name}, {splits} split"] = {"us": 1e3 * ms, "TBps": gb / ms, "max_err": err}
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": [heads, kv_heads, D, block_size],
                       "steps": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

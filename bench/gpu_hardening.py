"""H200 checks for the hardening issue: an LLM built three times in one variable (memory comes back), and
greedy fp32 parity with transformers through the Triton path for head dims that are not a power of two.

    python bench/gpu_hardening.py --out results.json
"""
import argparse
import gc
import json
import shutil
import tempfile
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.checks.lesson01 import hf_tiny_model
from nanoserve.model.zoo import resolve_model

GIB = 2**30
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rebuild_three_times() -> dict:
    rows, llm = [], None
    for i in range(3):
        llm = LLM("tiny-qwen3", max_model_len=512)  # re-assigned: the previous one is still alive while this builds
        tokens = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
        rows.append({"build": i, "ok": len(tokens) == 8, "kv_blocks": llm.cache.block_manager.num_blocks,
                     "reserved_gib": torch.cuda.memory_reserved() / GIB})
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"builds": rows, "reserved_gib_after_del": torch.cuda.memory_reserved() / GIB}


def parity(head_dim: int, kv_heads: int, heads: int) -> dict:
    hf = hf_tiny_model("Qwen3ForCausalLM", heads, kv_heads, head_dim, hidden=256, layers=2, vocab=512, tie=False, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        for f in Path(resolve_model("tiny-qwen3")).glob("tokenizer*"):
            shutil.copy(f, tmp)
        prompts = [[5, 9, 2, 44, 17] * k for k in (1, 3, 7)]
        llm = LLM(tmp, dtype="float32", max_model_len=512, num_gpu_blocks_override=256)
        ours = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
        uses_triton = llm.cache.kernels.__name__.endswith("triton_paged")
        llm.shutdown()
    hf = hf.to(DEVICE)
    theirs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device=DEVICE), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        theirs.append(out[0, len(p):].tolist())
    return {"head_dim": head_dim, "heads": heads, "kv_heads": kv_heads, "triton": uses_triton,
            "equal": [a == b for a, b in zip(ours, theirs)]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "rebuild": rebuild_three_times(),
              "parity": [parity(96, 2, 4), parity(256, 2, 8), parity(80, 1, 4)]}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

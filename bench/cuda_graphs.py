"""Lesson 06 on a GPU: CUDA graphs and fused ops give the eager engine's tokens (float32), keep bf16
parity with transformers, what capturing the graphs costs, and a profiler timeline of decode steps.

Run on a CUDA machine:  python bench/cuda_graphs.py --out results.json --trace trace.json
"""
import argparse
import json
import random
import time

import torch
import transformers

from nanoserve.engine.llm import LLM
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.zoo import resolve_model

MODEL = "qwen3-0.6b-random"
SWITCHES = {"eager": dict(enforce_eager=True, fused_ops=False, async_scheduling=False),
            "graphs": dict(enforce_eager=False, fused_ops=False, async_scheduling=False),
            "fused eager": dict(enforce_eager=True, fused_ops=True, async_scheduling=False),
            "graphs + fused": dict(enforce_eager=False, fused_ops=True, async_scheduling=False),
            "graphs + fused + async": dict(enforce_eager=False, fused_ops=True, async_scheduling=True)}


def requests(num: int = 24):
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(1, 200))] for _ in range(num)]
    params = []
    for i in range(num):
        kind = i % 5
        params.append(SamplingParams(
            temperature=[0, 0.8, 0.7, 1.0, 0][kind], top_k=20 if kind == 2 else 0, top_p=0.9 if kind == 3 else 1.0,
            seed=i, max_tokens=rng.randint(1, 40), ignore_eos=True, n=2 if i == 4 else 1,
            logprobs=3 if kind == 4 else None))
    return prompts, params


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], [[c.logprobs for c in o.outputs] for o in outs]


def max_logprob_diff(a, b):
    worst = 0.0
    for ra, rb in zip(a, b):
        for ca, cb in zip(ra, rb):
            for da, db in zip(ca or [], cb or []):
                worst = max(worst, max(abs(da[t] - db[t]) for t in da if t in db))
    return worst


def fp32_equality(result):
    prompts, params = requests()
    base = dict(dtype=torch.float32, max_model_len=1024, num_gpu_blocks_override=2048, max_num_seqs=20)
    with LLM(MODEL, **base, **SWITCHES["eager"]) as llm:
        ref_tokens, ref_lp = run(llm, prompts, params)
    out = result["fp32_same_tokens_as_eager"] = {}
    for name, switches in list(SWITCHES.items())[1:]:
        with LLM(MODEL, **base, **switches) as llm:
            tokens, lp = run(llm, prompts, params)
            out[name] = {"equal_requests": sum(a == b for a, b in zip(tokens, ref_tokens)), "of": len(prompts),
                         "max_logprob_diff": max_logprob_diff(lp, ref_lp),
                         "graph_sizes": llm.engine.runner.graphs.sizes if llm.engine.runner.graphs else []}
    small = dict(base, num_gpu_blocks_override=40, max_num_seqs=12, max_num_batched_tokens=64)
    with LLM(MODEL, **small, **SWITCHES["graphs + fused + async"]) as llm:
        tokens, _ = run(llm, prompts, params)
        out["graphs + fused + async, 40 blocks (preemption), chunked by 64"] = {
            "equal_requests": sum(a == b for a, b in zip(tokens, ref_tokens)), "of": len(prompts),
            "preemptions": llm.engine.stats.preemptions}
    print(json.dumps(out, indent=1), flush=True)


def agree(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bf16_parity(result):
    path = resolve_model(MODEL)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (64, 17, 100, 300)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        theirs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del hf
    out = result["bf16_greedy_common_prefix_with_transformers"] = {"of": 32}
    for name in ("eager", "graphs + fused + async"):
        with LLM(MODEL, dtype=torch.bfloat16, max_model_len=1024, num_gpu_blocks_override=512, **SWITCHES[name]) as llm:
            ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        out[name] = [agree(a, b) for a, b in zip(ours, theirs)]
    print(json.dumps(out), flush=True)


def capture_cost(result):
    out = result["capture"] = {}
    for max_num_seqs in (256, 512):
        llm = LLM(MODEL, max_model_len=4096, num_gpu_blocks_override=8192, max_num_seqs=max_num_seqs)
        llm.engine.runner  # noqa: B018 -- warm: the first engine also compiles; measure a second one
        llm.shutdown()
        llm = LLM(MODEL, max_model_len=4096, num_gpu_blocks_override=8192, max_num_seqs=max_num_seqs,
                  enforce_eager=True)
        _ = llm.engine
        torch.cuda.synchronize()
        eager_reserved = torch.cuda.memory_reserved()
        llm.shutdown()
        llm = LLM(MODEL, max_model_len=4096, num_gpu_blocks_override=8192, max_num_seqs=max_num_seqs)
        start = time.perf_counter()
        runner = llm.engine.runner
        seconds = time.perf_counter() - start
        out[max_num_seqs] = {"graphs": len(runner.graphs.graphs), "engine_build_s": seconds,
                             "extra_reserved_MiB": (torch.cuda.memory_reserved() - eager_reserved) / 2**20}
        llm.shutdown()
    print(json.dumps(out), flush=True)


def timeline(result, trace_file):
    """Kernels and launches of 3 batch-1 decode steps, eager vs graphs + fused (steps one after another)."""
    trace = {}
    for name in ("eager", "graphs + fused"):
        with LLM(MODEL, max_model_len=1024, num_gpu_blocks_override=512, **SWITCHES[name]) as llm:
            engine = llm.engine
            llm.generate([[1] * 16], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            engine.add_request(list(range(128)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            for _ in range(4):
                engine.step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
            while engine.has_unfinished():
                engine.step()
        events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                     "cuLaunchKernelEx", "cudaLaunchKernelExC")]
        t0 = min(e.time_range.start for e in events)
        trace[name] = {"gpu_kernels": [(e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in gpu],
                       "launches": [(e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in launches],
                       "wall_us": max(e.time_range.end for e in events) - t0, "steps": 3}
        result.setdefault("timeline_summary", {})[name] = {
            "kernels_per_step": len(gpu) / 3, "launch_calls_per_step": len(launches) / 3,
            "gpu_busy_us_per_step": sum(e.time_range.end - e.time_range.start for e in gpu) / 3,
            "wall_us_per_step": trace[name]["wall_us"] / 3}
    print(json.dumps(result["timeline_summary"]), flush=True)
    with open(trace_file, "w") as f:
        json.dump(trace, f)


def kernel_breakdown(result):
    """GPU time per kernel name over 3 decode steps at batch 1 and 256 (graphs + fused), and how long a
    replay of each small graph takes (is padding batch 1 up to a larger graph faster?)."""
    from collections import Counter

    out = result["kernels"] = {}
    with LLM(MODEL, max_model_len=2048, num_gpu_blocks_override=40000, **SWITCHES["graphs + fused"]) as llm:
        engine = llm.engine
        for batch in (1, 256):
            for _ in range(batch):
                engine.add_request(list(range(512)), SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True))
            for _ in range(12):
                engine.step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
            spent = Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    spent[e.name[:60]] += (e.time_range.end - e.time_range.start) / 3
            out[f"batch{batch}_us_per_step"] = dict(spent.most_common(25))
            out[f"batch{batch}_gpu_us_per_step"] = sum(spent.values())
            if batch == 1:
                runner = engine.runner
                runner.builder.dev_views["slot_mapping"].fill_(-1)  # replays below write no K/V
                replay = {}
                for size in runner.graphs.sizes[:6]:
                    graph = runner.graphs.graphs[size][0]
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(100):
                        graph.replay()
                    torch.cuda.synchronize()
                    replay[size] = (time.perf_counter() - start) * 10  # ms per replay
                out["replay_ms_by_graph_size"] = replay
            while engine.has_unfinished():
                engine.step()
    print(json.dumps(out, indent=1), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--parts", nargs="+", default=["fp32_equality", "bf16_parity", "capture_cost",
                                                        "kernel_breakdown", "timeline"])
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": MODEL}
    for part in args.parts:
        if part == "timeline":
            timeline(result, args.trace)
        else:
            globals()[part](result)
        with open(args.out, "w") as f:  # after every part: a later failure keeps what was measured
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

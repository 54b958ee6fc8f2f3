"""Where a step's time goes, on the CPU and on the GPU, for batch 1 and for the workload.

For each part: the engine's phases timed on the CPU (schedule, launch, the wait for the GPU inside collect,
the rest of collect, process) per step, then one pass under torch.profiler: the GPU's busy time (the union
of its kernels) against the wall time, the kernels by name, and the idle gaps on the GPU by the kernel that
ends them. If the event waits are near zero, the GPU waited for the CPU (the step is CPU-bound).

    python bench/time_split.py OUT.json [--model qwen3-0.6b-random]   (GPU only)
    python bench/time_split.py OUT.json --feature "min_p + logit_bias"   the workload (max_tokens capped at
        256) plain, then with a row of `nanoserve bench --features`, each timed then profiled
"""
import argparse
import collections
import json
import sys
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.bench import FEATURES, feature_params, warm_up_features, workload

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


class PhaseTimer:
    """Seconds spent in the engine's phases, by wrapping its methods (restored by `restore`)."""

    def __init__(self, llm):
        self.engine, self.runner, self.seconds, self.saved = llm.engine, llm.engine.runner, collections.Counter(), []
        for owner, name in ((self.engine, "schedule"), (self.engine, "launch"), (self.engine, "process"),
                            (self.runner, "collect")):
            self.wrap(owner, name)
        # inside launch
        from nanoserve.engine import model_runner
        for name in ("prepare_inputs", "rows_from_previous", "record_event"):
            self.wrap(model_runner, name, restore=getattr(model_runner, name))
        self.wrap(self.runner.builder, "build")
        self.wrap(self.runner, "draw")  # the draw, processors included
        for name in ("apply", "layout", "drawn", "ahead") if self.runner.processors is not None else ():
            self.wrap(self.runner.processors, name)  # the logits processors (built at a first feature): host time
        self.wrap(self.runner, "sampler", restore=self.runner.sampler)
        self.wrap(self.runner, "compute")
        if hasattr(self.runner.sampler, "pick"):
            self.wrap(self.runner.sampler, "pick", restore=self.runner.sampler.pick)
        done_sync = torch.cuda.Event.synchronize

        def synchronize(event):  # the CPU's waits for the GPU: collect's, and the builder's for its buffers
            start = time.perf_counter()
            try:
                return done_sync(event)
            finally:
                self.seconds["event waits"] += time.perf_counter() - start
        self.saved.append((torch.cuda.Event, "synchronize", done_sync))
        torch.cuda.Event.synchronize = synchronize

    def wrap(self, owner, name, restore=None):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        self.saved.append((owner, name, restore))
        setattr(owner, name, timed)

    def restore(self):
        for owner, name, value in reversed(self.saved):
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def run_timed(llm, prompts, params):
    steps_before = llm.engine.stats.steps
    timer = PhaseTimer(llm)
    sync()
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync()
    finally:
        timer.restore()
    wall = time.perf_counter() - start
    steps = llm.engine.stats.steps - steps_before
    ms = {k: 1e3 * v / steps for k, v in timer.seconds.items()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "steps": steps, "tok_per_s": tokens / wall, "ms_per_step": ms,
            "ms_per_step_wall": 1e3 * wall / steps}


def gpu_profile(llm, prompts, params, top: int = 25):
    """The GPU's busy time against the wall, kernels by name, and idle gaps by the kernel that ends them."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - start
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps, by_name, end = 0.0, collections.Counter(), collections.defaultdict(lambda: [0, 0.0]), None
    gap_count = collections.Counter()
    for s, e, name in kernels:
        by_name[name[:90]][0] += 1
        by_name[name[:90]][1] += e - s
        if end is None or s >= end:
            busy += e - s
            if end is not None and s - end > 3:  # gaps over 3 us, in microseconds
                gaps[name[:90]] += s - end
                gap_count[name[:90]] += 1
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    # for the copies, what runs around them (which op of the layer they belong to)
    around = collections.Counter((kernels[i - 1][2][:60], kernels[i + 1][2][:60]) for i in range(1, len(kernels) - 1)
                                 if "elementwise_kernel" in kernels[i][2] or "direct_copy" in kernels[i][2])
    return {"wall_s_profiled": wall, "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "kernels": len(kernels),
            "by_name_ms": sorted(([n, c, t / 1e3] for n, (c, t) in by_name.items()), key=lambda r: -r[2])[:top],
            "idle_gaps_ms_by_next_kernel": sorted(([n, gap_count[n], g / 1e3] for n, g in gaps.items()),
                                                  key=lambda r: -r[2])[:top],
            "copies_between": [[a, b, n] for (a, b), n in around.most_common(8)]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--skip-workload-profile", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=256)  # fewer: a dry run on a CPU
    parser.add_argument("--feature", choices=[f for f in FEATURES if f != "plain"])
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=4096)
    if args.feature:
        return split_feature(llm, args)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    import random
    one = [random.Random(1).choices(range(10000), k=128)]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=512)
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model}
    result["bs1"] = run_timed(llm, one, greedy)
    result["bs1_again"] = run_timed(llm, one, greedy)
    print(json.dumps(result, indent=1), flush=True)
    result["bs1_profile"] = gpu_profile(llm, one, SamplingParams(temperature=0, ignore_eos=True, max_tokens=128))
    prompts, max_tokens = workload(args.num_seqs, max_output_len=1024 if args.num_seqs == 256 else 32)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    result["workload"] = run_timed(llm, prompts, params)
    print(json.dumps(result["workload"], indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if not args.skip_workload_profile:
        result["workload_profile"] = gpu_profile(llm, prompts, params)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if "profile" in k}, indent=1)[:6000])
    llm.shutdown()
    return 0


def split_feature(llm, args) -> int:
    """The workload as `nanoserve bench --features` runs it, plain and with one feature row, alternating twice."""
    warm_up_features(llm)
    prompts, wanted = workload(args.num_seqs)
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # the prompts in the prefix cache
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model}
    for r, row in enumerate(["plain", args.feature, args.feature, "plain"]):
        result[f"{row} timed {r}"] = run_timed(llm, prompts, feature_params(row, wanted))
        print(row, json.dumps(result[f"{row} timed {r}"]), flush=True)
    if torch.cuda.is_available():
        for row in ("plain", args.feature):
            result[f"{row} profile"] = gpu_profile(llm, prompts, feature_params(row, wanted))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if "profile" in k}, indent=1)[:8000])
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

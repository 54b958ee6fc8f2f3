"""H200: the engine of two source trees side by side, in one run (issue: one step-metadata object).

For each tree (a checkout holding a `nanoserve/` package), in a fresh process whose working directory is
that tree: `nanoserve bench`'s workload through LLM (throughput), then 256 sequences decoding together
(prompts of the workload, long max_tokens): wall time per decode step, and a torch.profiler trace of 8 of
those steps -> CPU time per step (wall minus the time blocked waiting for the GPU), kernel launches and
GPU kernel time per step.

    python bench/engine_before_after.py OLD_TREE NEW_TREE --out results.json
    (on a CPU, for a dry run: --model tiny-qwen3 --num-seqs 8 --max-len 100)
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import json, random, sys, time
    import torch
    from torch.profiler import ProfilerActivity, profile
    from nanoserve import LLM, SamplingParams
    from nanoserve.bench import workload

    model, num_seqs, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    prompts, max_tokens = workload(num_seqs, max_len, max_len)
    llm = LLM(model, max_model_len=4096)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    sync()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    out["bench"] = {"seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds}

    engine = llm.engine
    for p in prompts:  # 256 sequences, all decoding once their prompts are in
        engine.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2000))
    while True:  # until every sequence is in and decoding
        tokens = [t for _, t in engine.step()]
        if not engine.scheduler.waiting and None not in tokens:
            break
    for _ in range(3):
        engine.step()
    walls = []
    for _ in range(16):
        sync(); t = time.perf_counter(); engine.step(); sync()
        walls.append(time.perf_counter() - t)
    out["decode_all_wall_ms"] = 1000 * sorted(walls)[len(walls) // 2]
    steps = 8
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        sync(); t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(); wall = time.perf_counter() - t
    ev = {e.key: e for e in prof.key_averages()}
    def self_cpu_us(name):
        return ev[name].self_cpu_time_total if name in ev else 0.0
    waiting = sum(self_cpu_us(n) for n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                                            "cudaEventSynchronize"))
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    out["decode_all_profiled"] = {
        "steps": steps, "wall_ms_per_step": 1000 * wall / steps,
        "blocked_on_gpu_ms_per_step": waiting / 1000 / steps,
        "cpu_ms_per_step": (1e6 * wall - waiting) / 1000 / steps,
        "gpu_kernel_ms_per_step": gpu_us / 1000 / steps,
        "kernel_launches_per_step": (ev["cudaLaunchKernel"].count if "cudaLaunchKernel" in ev else 0) / steps,
    }
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.scheduler.abort(seq)
    print("RESULT " + json.dumps(out))
''')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--num-seqs", default=256, type=int)
    parser.add_argument("--max-len", default=1024, type=int, help="longest prompt and output (the workload's 1024)")
    args = parser.parse_args()
    results = {"device": None}
    import torch
    results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for tree in args.trees:
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.num_seqs), str(args.max_len)], cwd=tree,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.path.abspath(tree)})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            results[tree] = {"error": proc.stderr[-3000:]}
        else:
            results[tree] = json.loads(line[0][len("RESULT "):])
        print(tree, json.dumps(results[tree], indent=1), flush=True)
        with open(args.out, "w") as f:  # after each tree: a time limit never loses a finished one
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

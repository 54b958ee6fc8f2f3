"""Start-up, from LLM(...) to the first token (the goal: <= 15 s with warm compile caches, <= 30 s on
a fresh machine), each run in a fresh process: first with empty torch.compile and Triton caches, then again
with the caches the first run left. Each run splits its time into the warm-up compiles, the graph
recording, and the rest (loading the weights, the KV pool, the first request).

    python bench/startup.py OUT.json [--model qwen3-0.6b-random] [--runs 2] [--profile PROFILE.txt]   (GPU only)

--profile: one more warm run under cProfile (its 60 costliest calls, cumulative) with torch.compile's
recompile log (TORCH_LOGS=recompiles), written to PROFILE.txt.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent('''
    import json, sys, time
    start = time.perf_counter()
    from nanoserve.engine import cuda_graphs
    spent = {"warm_up": 0.0, "record graphs": 0.0}

    def timed(name, inner):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return run

    cuda_graphs.warm_up = timed("warm_up", cuda_graphs.warm_up)
    cuda_graphs.CUDAGraphs.record = timed("record graphs", cuda_graphs.CUDAGraphs.record)
    from nanoserve import LLM, SamplingParams
    imported = time.perf_counter() - start
    llm = LLM(sys.argv[1], max_model_len=4096)
    built = time.perf_counter() - start
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - start
    print("RESULT " + json.dumps({"to_first_token_s": first, "import_s": imported, "LLM_s": built - imported,
                                  "first_request_s": first - built, **{k + "_s": v for k, v in spent.items()}}))
''')


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--profile")
    args = parser.parse_args()
    caches = tempfile.mkdtemp(prefix="startup-caches-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
    runs = []
    for i in range(args.runs):
        done = subprocess.run([sys.executable, "-c", CHILD, args.model], env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise RuntimeError(done.stderr[-3000:])
        runs.append({"caches": "empty" if i == 0 else "warm", **json.loads(lines[-1][len("RESULT "):])})
        print(runs[-1], flush=True)
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "runs": runs}, f, indent=1)
    if args.profile:
        stats, child = args.profile + ".prof", os.path.join(caches, "child.py")
        with open(child, "w") as f:
            f.write(CHILD)
        done = subprocess.run([sys.executable, "-m", "cProfile", "-o", stats, child, args.model],
                              env={**env, "TORCH_LOGS": "recompiles"}, capture_output=True, text=True)
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(stats, stream=text).sort_stats("cumulative").print_stats(60)
        with open(args.profile, "w") as f:
            f.write(done.stdout[-2000:] + "\n--- recompiles (stderr) ---\n" + done.stderr[-20000:] + "\n" + text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""H200: two source trees' engines, alternating, each run in a fresh process (the code before a change against after it).

Each run: LLM(model) as `nanoserve bench` builds it (start-up timed), the benchmark workload (256 requests),
then batch 1 (a 128-token prompt, 512 greedy tokens). Rounds alternate the order, so drift in the machine
falls on both trees alike; the summary gives each tree's median and the new/old ratios.

    python bench/compare_trees.py OLD_TREE NEW_TREE --rounds 3 --out results.json
    (on a CPU, a dry run: --model tiny-qwen3 --num-seqs 4)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import json, sys, time
    from nanoserve import LLM, SamplingParams
    from nanoserve.bench import bench_batch1, bench_nanoserve, workload

    model, num_seqs = sys.argv[1], int(sys.argv[2])
    prompts, max_tokens = workload(num_seqs)
    start = time.perf_counter()
    llm = LLM(model, max_model_len=4096)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    startup = time.perf_counter() - start
    w = bench_nanoserve(llm, prompts, max_tokens)
    b = bench_batch1(llm)
    print("RESULT " + json.dumps({"startup_s": startup, "tok_per_s": w["tok_per_s"], "bs1_tok_per_s": b["tok_per_s"],
                                  "prefill_steps": w["prefill_steps"], "decode_only_steps": w["decode_only_steps"]}))
''')


def run(tree: str, model: str, num_seqs: int) -> dict:
    # the tree first; the caller's PYTHONPATH (its installed packages) after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(tree)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    done = subprocess.run([sys.executable, "-c", CHILD, model, str(num_seqs)], cwd=tree, env=env,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            found = run(getattr(args, name), args.model, args.num_seqs)
            runs[name].append(found)
            print(f"round {r + 1} {name}: {found}", flush=True)
            summary = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items() if rs}
            if runs["old"] and runs["new"]:
                summary["new/old"] = {k: summary["new"][k] / summary["old"][k] for k in ("tok_per_s", "bs1_tok_per_s")}
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "runs": runs, "median": summary}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

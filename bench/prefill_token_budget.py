"""H200: the prefill token budget (max_num_batched_tokens) 8192 against nano-vllm's 16384: the
workload's throughput and its prefill steps, each setting in a fresh process, two rounds alternating; then
the server at each setting under `nanoserve bench-serve` (the course workload, 128 requests, at 16 req/s and
all at once): TTFT and ITL.

    python bench/prefill_token_budget.py OUT.json
"""
import json
import socket
import subprocess
import sys
import time
import urllib.request

MODEL = "qwen3-0.6b-random"
CHILD = '''
import json, sys
from nanoserve import LLM, SamplingParams
from nanoserve.bench import bench_nanoserve, workload
prompts, max_tokens = workload(256)
llm = LLM(sys.argv[1], max_model_len=4096, max_num_batched_tokens=int(sys.argv[2]))
llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
print(json.dumps(bench_nanoserve(llm, prompts, max_tokens)))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_bench(budget: int, out: str) -> dict:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", MODEL, "--port", str(port),
                               "--max-num-batched-tokens", str(budget), "--disable-log-requests",
                               "--uvicorn-log-level", "warning"])
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        subprocess.run([sys.executable, "-m", "nanoserve.cli", "bench-serve", "--port", str(port), "--model", MODEL,
                        "--num-prompts", "128", "--request-rate", "16", "inf", "--percentile-metrics", "ttft,tpot,itl",
                        "--metric-percentiles", "50,99", "--out", out], check=True)
        return json.load(open(out))
    finally:
        server.terminate()
        server.wait(60)


def main(out_path: str) -> None:
    results = {"offline": {"8192": [], "16384": []}, "serve": {}}
    for round_ in range(2):
        for budget in ((8192, 16384) if round_ % 2 == 0 else (16384, 8192)):
            done = subprocess.run([sys.executable, "-c", CHILD, MODEL, str(budget)], capture_output=True, text=True,
                                  check=True)
            results["offline"][str(budget)].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(budget, results["offline"][str(budget)][-1], flush=True)
    for budget in (8192, 16384):
        results["serve"][str(budget)] = serve_bench(budget, f"/tmp/serve_{budget}.json")["runs"]
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

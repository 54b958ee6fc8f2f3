"""Lesson 08 on a GPU: `nanoserve serve` against `transformers serve --continuous-batching`, same model
(Qwen3-0.6B shapes, random bf16 weights), same requests, with `nanoserve bench-serve`'s client at three
request rates. Writes serve_bench.json (both servers, every rate, and any server that failed to start,
with its log's tail) and serve_latency.png into the output directory.

Run on a CUDA machine (fastapi, uvicorn, pydantic, openai from bench/wheels.sh):
    python bench/serving.py OUT_DIR [--servers nanoserve transformers] [--rates 2 8 inf]
Two calls (one server each, to stay within a command's time limit), joined afterwards on any machine:
    python bench/serving.py OUT_DIR --merge a/serve_bench.json b/serve_bench.json
"""
import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanoserve.model.loader import load_tokenizer
from nanoserve.model.zoo import resolve_model
from nanoserve.serve.benchmark import (DEFAULT_EXTRA_BODY, course_requests, parse_rate, plot_latency, print_summary,
                                       run_at_rate)

MODEL = "qwen3-0.6b-random"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformers_commands(model_dir: str, port: int) -> list[list[str]]:
    """`transformers serve` spellings to try: 5.x takes the model as an argument; older ones as an option."""
    exe = [shutil.which("transformers")] if shutil.which("transformers") else [sys.executable, "-m",
                                                                               "transformers.cli.transformers"]
    tail = ["--port", str(port), "--host", "127.0.0.1"]
    return [exe + ["serve", model_dir, "--continuous-batching", *tail],
            exe + ["serve", "--force-model", model_dir, "--continuous-batching", *tail],
            exe + ["serve", "--force_model", model_dir, "--continuous_batching", *tail]]


class Server:
    """A server process, its log in a file, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.command, self.url, self.log_path = command, f"http://127.0.0.1:{port}", log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, seconds: float, model_id: str | None = None) -> str:
        """The served model's id (model_id if given), once /v1/models answers; raises if the process dies or
        time runs out."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.tail()}")
            try:
                reply = httpx.get(f"{self.url}/v1/models", timeout=5)
                if reply.status_code == 200 and (model_id or reply.json().get("data")):
                    return model_id or reply.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready after {seconds:.0f} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its whole session: no process left behind
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def bench(server: Server, model_id: str, requests, rates, tokenizer, extra: dict) -> list[dict]:
    warm = asyncio.run(run_at_rate(server.url, model_id, requests[:4], float("inf"), "chat", extra, tokenizer))
    print(f"warm-up: {warm['completed']} done, {warm['failed']} failed {warm['errors']}", flush=True)
    runs = []
    for rate in rates:
        summary = asyncio.run(run_at_rate(server.url, model_id, requests, rate, "chat", extra, tokenizer))
        print_summary(summary)
        runs.append(summary)
    return runs


def merge(paths: list[str], out: Path) -> None:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    result = {**parts[0], "servers": {}, "failed_to_start": {}}
    for part in parts:
        result["servers"].update(part["servers"])
        result["failed_to_start"].update(part["failed_to_start"])
    (out / "serve_bench.json").write_text(json.dumps(result, indent=2))
    plot_latency({n: s["runs"] for n, s in result["servers"].items()}, str(out / "serve_latency.png"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=MODEL, help="(tiny-qwen3 tries the script on a CPU)")
    parser.add_argument("--servers", nargs="+", default=["nanoserve", "transformers"],
                        choices=["nanoserve", "transformers"])
    parser.add_argument("--rates", nargs="+", default=["2", "8", "inf"])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--merge", nargs="+", default=None,
                        help="join these serve_bench.json files into OUT_DIR (JSON and plot), run nothing")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, out)
    model_dir = str(resolve_model(args.model))
    tokenizer = load_tokenizer(model_dir)
    # The chat endpoint: the one both servers have. Every server gets the same prompts and lengths.
    requests = course_requests(tokenizer, args.num_prompts, args.max_input_len, args.max_output_len)
    rates = [parse_rate(r) for r in args.rates]
    result = {"model": args.model, "endpoint": "chat", "num_requests": len(requests), "rates": args.rates,
              "workload": {"max_input_len": args.max_input_len, "max_output_len": args.max_output_len},
              "servers": {}, "failed_to_start": {}}
    for name in args.servers:
        if name == "nanoserve":
            port = free_port()
            attempts = [[sys.executable, "-m", "nanoserve.cli", "serve", args.model, "--port", str(port),
                         "--max-model-len", str(args.max_input_len + args.max_output_len + 512)]]
            extra = json.loads(DEFAULT_EXTRA_BODY)
        else:
            port = free_port()
            attempts = transformers_commands(model_dir, port)
            extra = {"temperature": 0.6}  # it refuses unknown fields (ignore_eos) and ignores stream_options
        # transformers serve lists models by scanning the Hugging Face cache, and answers 500 where that folder
        # does not exist (as on a fresh GPU machine, 2026-11-30): give it an empty one. Its model is the forced one.
        env = {} if name == "nanoserve" else {"HF_HUB_CACHE": tempfile.mkdtemp(prefix="hf-hub-")}
        expected = None if name == "nanoserve" else model_dir
        for i, command in enumerate(attempts):
            server = Server(command, port, out / f"{name}_{i}.log", env)
            try:
                model_id = server.wait_ready(300, expected)
                print(f"{name}: {' '.join(command)} serves {model_id}", flush=True)
                start = time.perf_counter()
                result["servers"][name] = {"command": command, "runs": bench(server, model_id, requests, rates,
                                                                             tokenizer, extra)}
                result["servers"][name]["bench_seconds"] = time.perf_counter() - start
                break
            except RuntimeError as e:
                result["failed_to_start"].setdefault(name, []).append({"command": command, "error": str(e)})
                print(f"{name}: {' '.join(command)} failed: {e}", flush=True)
            finally:
                code = server.stop()
                if name in result["servers"]:
                    result["servers"][name]["exit_code_after_sigterm"] = code
        (out / "serve_bench.json").write_text(json.dumps(result, indent=2))
    if result["servers"]:
        plot_latency({n: s["runs"] for n, s in result["servers"].items()}, str(out / "serve_latency.png"))
    print(json.dumps({n: [(r["request_rate"], round(r["output_throughput"]), r["failed"]) for r in s["runs"]]
                      for n, s in result["servers"].items()}), flush=True)


if __name__ == "__main__":
    main()

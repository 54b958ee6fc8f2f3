"""Tensor parallelism's lifecycle on two GPUs, each case in a process of its own under a time limit:

  kill CUSTOM     SIGKILL rank 1 in the middle of a TP=2 generate: seconds until rank 0 raises; then, in the
                  same process, is CUDA still usable, and does a new TP=2 LLM give the same tokens as before?
                  CUSTOM: nccl (the default) or one-shot (custom_all_reduce=True)
  pair            two TP=2 engines at the same time on the same two GPUs (0.4 of the memory each): both give
                  the tokens of one engine alone

    python bench/tp_lifecycle.py OUT.json [kill] [pair]    (default: both)
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], list(range(100, 160))]


def child_kill(custom: str) -> None:
    import torch

    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    args = dict(tensor_parallel_size=2, max_model_len=4096, custom_all_reduce=custom == "one-shot")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM("tiny-qwen3", **args)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    pid = llm.workers.procs[0].pid
    killed = []
    threading.Timer(2.0, lambda: (killed.append(time.monotonic()), os.kill(pid, signal.SIGKILL))).start()
    found = {}
    try:
        llm.generate([[1, 2, 3]] * 64, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
        found["raised"] = None  # finished before the kill: say so, and go on
        llm.shutdown()
    except RuntimeError as e:
        found["raised"] = str(e).splitlines()[0]
        found["seconds_to_error"] = time.monotonic() - killed[0]
    print("RESULT", json.dumps(found), flush=True)
    if torch.cuda.is_available():
        start = time.monotonic()
        torch.cuda.synchronize()
        found["cuda_sync_s"] = time.monotonic() - start
    print("RESULT", json.dumps(found), flush=True)
    try:
        with LLM("tiny-qwen3", **args) as again:
            after = [o.outputs[0].token_ids for o in again.generate(PROMPTS, greedy, use_tqdm=False)]
        found["new_llm_same_tokens"] = after == before
    except RuntimeError as e:
        found["new_llm_refused"] = str(e)
    print("RESULT", json.dumps(found), flush=True)


def child_pair(index: str) -> None:
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM("tiny-qwen3", tensor_parallel_size=2, max_model_len=1024, gpu_memory_utilization=0.4) as llm:
        for _ in range(20):  # keep both engines busy at the same time for a while
            out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    print("RESULT", json.dumps({"engine": index, "tokens": out}), flush=True)


def start(cmd: list[str]) -> subprocess.Popen:
    """A command in a session of its own (so that its whole process tree can be signalled), every
    process of it with faulthandler on."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def output(proc: subprocess.Popen, limit: float) -> str:
    """Its output once it exits; after `limit` seconds every process of it prints its stacks and is killed."""
    try:
        return proc.communicate(timeout=limit)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler: stacks of every process
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0]


def run(args: list[str], limit: float):
    return start([sys.executable, __file__, *args]), limit


def finish(proc, limit) -> tuple[list[dict], str, int]:
    log = output(proc, limit)
    results = [json.loads(line[7:]) for line in log.splitlines() if line.startswith("RESULT ")]
    log = "\n".join(line for line in log.splitlines() if not line.startswith("Extension modules"))
    return results, log[-20000:], proc.returncode


if __name__ == "__main__":
    if sys.argv[1] == "--kill":
        child_kill(sys.argv[2])
    elif sys.argv[1] == "--pair":
        child_pair(sys.argv[2])
    else:
        out, cases = {}, sys.argv[2:] or ["kill", "pair"]
        for custom in ("nccl", "one-shot") if "kill" in cases else ():
            results, log, code = finish(*run(["--kill", custom], 100 if custom == "nccl" else 75))
            out[f"kill {custom}"] = {"found": results[-1] if results else None, "exit": code, "log_tail": log}
            print(f"kill {custom}: {results[-1] if results else None}; exit {code}", flush=True)
        both = [run(["--pair", str(i)], 150) for i in range(2)] if "pair" in cases else []
        found = [finish(*b) for b in both]
        tokens = [r[0][-1]["tokens"] if r[0] else None for r in found]
        out["pair"] = {} if not both else {"exits": [r[2] for r in found], "same_tokens": tokens[0] is not None and tokens[0] == tokens[1],
                       "log_tails": [r[1] for r in found]}
        print(f"pair: {out['pair'].get('exits')} exits, same tokens {out['pair'].get('same_tokens')}", flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)

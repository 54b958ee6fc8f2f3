"""Lesson 07 on two GPUs: tensor parallelism. In one invocation, each phase printing as it goes and
saving its results to OUT_DIR/lesson07.json before the next starts:

  prepare   build qwen3-8b-random (16 GB, four shards) and time it; the other models too
  parity    TP=2 vs TP=1 greedy tokens in fp32 (tiny-qwen3; 4 layers of the 0.6B shapes), under
            chunked prefill and preemption, at default settings (graphs, async); bf16 agreement on
            qwen3-0.6b-random: per prompt, tokens agreeing before the first divergence, of 32
  bench8b   `nanoserve bench`'s workload on qwen3-8b-random, TP=1 and TP=2, each in a fresh process
            (their batch-1 decode tok/s come with them)
  bench06   the same for qwen3-0.6b-random (256 requests)
  split     one 8B TP=2 decode step: its time (batch 1 and 64) against the time of its collectives
            alone (73 all-reduces of [batch, 4096] bf16 and the logits' all-gather, replayed in a
            CUDA graph on two fresh ranks)

Run on a machine with 2 GPUs:  python bench/gpu_lesson07.py OUT_DIR [--num-requests 128] [--phases ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# No NVLink multicast (NVLS) in NCCL or symmetric memory: set before torch loads, and inherited by every
# process started from here (the engine's workers, the bench subprocesses).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from nanoserve.engine.llm import LLM  # noqa: E402
from nanoserve.engine.sampling_params import SamplingParams  # noqa: E402
from nanoserve.model.zoo import build_qwen3_0_6b_random, resolve_model  # noqa: E402

BIG = "qwen3-8b-random"
SMALL = "qwen3-0.6b-random"


def say(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def prepare(result, args):
    out = result["prepare"] = {}
    for name in (BIG, SMALL, "tiny-qwen3"):
        start = time.perf_counter()
        path = resolve_model(name)
        out[name] = {"seconds": time.perf_counter() - start,
                     "files": sorted(p.name for p in path.glob("*.safetensors*"))}
        say(f"prepare {name}: {out[name]['seconds']:.1f} s, {out[name]['files']}")


def parity_requests(num=24):
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 10000, (40,), generator=gen).tolist()  # shared: prefix caching hits
    prompts = [(prefix if i % 2 else []) + torch.randint(0, 10000, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(1, 300, (num,), generator=gen))]
    return prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def tokens(model, prompts, params, **kw):
    start = time.perf_counter()
    with LLM(str(model), **kw) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm.engine
    return out, {"seconds": time.perf_counter() - start, "preemptions": engine.stats.preemptions,
                 "steps_ahead": getattr(engine, "steps_ahead", None)}


def agree(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parity(result, args):
    out = result["parity"] = {}
    prompts, params = parity_requests()
    four_layers = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-4layers-"))
    build_qwen3_0_6b_random(four_layers, num_hidden_layers=4)
    # fp32, default switches (graphs, fused ops, async), small pools: chunked prefill and preemption
    tight = dict(dtype=torch.float32, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                 num_gpu_blocks_override=120)
    for name, model in (("tiny-qwen3 fp32", "tiny-qwen3"), ("0.6B shapes, 4 layers, fp32", four_layers)):
        want, info1 = tokens(model, prompts, params, **tight)
        got, info2 = tokens(model, prompts, params, tensor_parallel_size=2, **tight)
        out[name] = {"equal_requests": sum(a == b for a, b in zip(want, got)), "of": len(prompts),
                     "agree_before_divergence": [agree(a, b) for a, b in zip(want, got)], "tp1": info1, "tp2": info2}
        say(f"parity {name}: {out[name]['equal_requests']}/{len(prompts)} requests equal; TP=1 {info1}, TP=2 {info2}")
        result_saved(result, args)
    bf16 = dict(dtype=torch.bfloat16, max_model_len=1024, max_num_seqs=16)
    want, _ = tokens(SMALL, prompts, params, **bf16)
    got, _ = tokens(SMALL, prompts, params, tensor_parallel_size=2, **bf16)
    agreeing = [agree(a, b) for a, b in zip(want, got)]
    out["qwen3-0.6b-random bf16"] = {"agree_before_divergence": agreeing, "of": 32,
                                     "mean": sum(agreeing) / len(agreeing),
                                     "all_32": sum(n == 32 for n in agreeing), "prompts": len(prompts)}
    say(f"parity bf16 0.6B: {out['qwen3-0.6b-random bf16']}")


def bench_process(model, tp, num_requests, out_dir, timeout):
    """`nanoserve bench` in a fresh process; its JSON, or why there is none."""
    out = Path(out_dir) / f"bench-{model}-tp{tp}.json"
    cmd = [sys.executable, "-m", "nanoserve.cli", "bench", "--model", model, "--num-seqs", str(num_requests),
           "--no-baseline", "--out", str(out), "--tensor-parallel-size", str(tp)]
    say("running", " ".join(cmd))
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        say(f"{model} TP={tp}: timed out after {timeout} s")
        return {"error": f"timed out after {timeout} s", "stderr_tail": tail[-2000:]}
    found = {"wall_s": time.perf_counter() - start, "returncode": run.returncode, "stderr_tail": run.stderr[-1500:]}
    if run.returncode == 0 and out.is_file():
        found.update(json.loads(out.read_text()))
    last = run.stderr.strip().splitlines()[-1:] or [""]
    say(f"{model} TP={tp}: exit status {run.returncode} after {found['wall_s']:.0f} s; {last[0]}")
    return found


def bench_pair(result, args, key, model, num_requests, timeout):
    out = result[key] = {}
    for tp in (1, 2):
        out[f"tp{tp}"] = bench_process(model, tp, num_requests, args.out_dir, timeout)
        result_saved(result, args)
    try:
        w1, w2 = out["tp1"]["nanoserve"], out["tp2"]["nanoserve"]
        out["throughput_tp2_over_tp1"] = w2["tok_per_s"] / w1["tok_per_s"]
        out["bs1_tok_per_s"] = {"tp1": out["tp1"]["bs1"]["tok_per_s"], "tp2": out["tp2"]["bs1"]["tok_per_s"]}
        say(f"{key}: TP=2/TP=1 throughput {out['throughput_tp2_over_tp1']:.2f}x; batch 1 {out['bs1_tok_per_s']}")
    except KeyError:
        say(f"{key}: a run failed, see its stderr_tail")


def bench8b(result, args):
    bench_pair(result, args, "bench_8b", BIG, args.num_requests, timeout=240)


def bench06(result, args):
    bench_pair(result, args, "bench_0.6b", SMALL, 256, timeout=150)


def decode_step_ms(llm, batch: int, steps: int = 30) -> float:
    """Mean time of a decode-only step at this batch (steps one after another, async off)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request([(7 * i + j) % 10000 for j in range(128)],
                           SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True))
    while engine.scheduler.waiting or any(not s.num_output_tokens for s in engine.scheduler.running):
        engine.step()  # prefill everybody
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # each step reads its tokens on the host: it ends when the GPU is done
    ms = (time.perf_counter() - start) * 1000 / steps
    while engine.has_unfinished():
        engine.step()
    return ms


def comm_rank(rank, port, shapes, queue):
    """One of two fresh ranks: replay a decode step's collectives alone (73 all-reduces of [batch,
    hidden] and one all-gather of [batch, vocab / 2]) in a CUDA graph, as the engine replays them."""
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent holds the store
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    found = {}
    for batch, hidden, layers, vocab_half in shapes:
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(batch, vocab_half, device="cuda", dtype=torch.bfloat16)
        parts = [torch.empty_like(logits) for _ in range(2)]

        def collectives():
            for _ in range(2 * layers + 1):  # o_proj and down_proj of every layer, and the embedding
                dist.all_reduce(x)
            dist.all_gather(parts, logits)

        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            collectives()  # warm-up, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            collectives()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        found[batch] = (time.perf_counter() - start) * 1000 / 50
    if rank == 0:
        queue.put(found)
    dist.destroy_process_group()


def split(result, args):
    out = result["split_8b_tp2"] = {}
    batches = (1, 64)
    with LLM(BIG, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=64, async_scheduling=False) as llm:
        for b in batches:
            out[f"step_ms_batch{b}"] = decode_step_ms(llm, b)
            say(f"8B TP=2 decode step at batch {b}: {out[f'step_ms_batch{b}']:.2f} ms")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # any free port
    port = store.port
    shapes = [(b, 4096, 36, 151936 // 2) for b in batches]
    procs = [ctx.Process(target=comm_rank, args=(r, port, shapes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    comm = queue.get(timeout=180)
    for p in procs:
        p.join(30)
    for b in batches:
        step, c = out[f"step_ms_batch{b}"], comm[b]
        out[f"batch{b}"] = {"step_ms": step, "collectives_ms": c, "compute_and_rest_ms": step - c,
                            "collectives_share": c / step}
        say(f"batch {b}: step {step:.2f} ms, collectives alone {c:.3f} ms ({c / step:.0%})")


def result_saved(result, args):
    with open(Path(args.out_dir) / "lesson07.json", "w") as f:
        json.dump(result, f, indent=1, default=str)


PHASES = {"prepare": prepare, "parity": parity, "bench8b": bench8b, "bench06": bench06, "split": split}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--num-requests", type=int, default=128, help="requests of the 8B workload (default 128)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    args = parser.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        sys.exit("gpu_lesson07.py needs 2 GPUs")
    result = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "nccl": str(torch.cuda.nccl.version()), "num_requests_8b": args.num_requests}
    for phase in args.phases:
        start = time.perf_counter()
        say(f"--- {phase}")
        try:
            PHASES[phase](result, args)
        except Exception as e:  # keep going: the other phases still measure something
            result.setdefault("errors", {})[phase] = f"{type(e).__name__}: {e}"
            say(f"{phase} failed: {type(e).__name__}: {e}")
        result.setdefault("phase_seconds", {})[phase] = time.perf_counter() - start
        result_saved(result, args)
    say(f"done: {Path(args.out_dir) / 'lesson07.json'}")


if __name__ == "__main__":
    main()

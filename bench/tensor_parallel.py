"""Lesson 07 on two GPUs: tensor parallelism. In one invocation, each phase printing as it goes and
saving its results to OUT_DIR/tensor_parallel.json before the next starts:

  prepare    build qwen3-8b-random (16 GB, four shards) and time it; the other models too
  allreduce  NCCL's all-reduce against the one-shot all-reduce (OneShotTPGroup) on two fresh ranks: the
             same sums? and µs per all-reduce, replayed in a CUDA graph, from 8 KB to 8 MB
  parity     TP=2 vs TP=1 greedy tokens in fp32 (tiny-qwen3; 4 layers of the 0.6B shapes), under
             chunked prefill and preemption, at default settings (graphs, async); bf16 agreement on
             qwen3-0.6b-random: per prompt, tokens agreeing before the first divergence, of 32.
             Every engine runs in a process of its own (bench/tp_tokens.py) under a time limit.
  bench8b    `nanoserve bench`'s workload on qwen3-8b-random, TP=1, TP=2 and TP=2 with the one-shot all-reduce, each in
             a fresh process (their batch-1 decode tok/s come with them)
  bench06    the same for qwen3-0.6b-random (256 requests)
  split      one 8B TP=2 decode step (batch 1 and 64), one-shot and NCCL-only, against the time of its
             collectives alone (73 all-reduces of [batch, 4096] bf16 and the logits' all-gather, replayed
             in a CUDA graph on two fresh ranks)

A worker killed mid-generate, and two engines at once: bench/tp_lifecycle.py.

Run on a machine with 2 GPUs:  python bench/tensor_parallel.py OUT_DIR [--num-requests 128] [--phases ...]
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
from nanoserve.model.tp_layers import OneShotTPGroup  # noqa: E402
from nanoserve.model.offline_models import build_qwen3_0_6b_random  # noqa: E402
from nanoserve.model.zoo import resolve_model  # noqa: E402
from tp_lifecycle import output, start  # noqa: E402  (bench/, the script's folder)

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


def agree(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def engine_tokens(model, tp, dtype, tight, limit=200):
    """bench/tp_tokens.py in a process of its own session: its tokens, or why there are none. On a hang
    every process of it (the engine's workers too) prints its Python stacks before it is killed."""
    out = Path(tempfile.gettempdir()) / f"tokens-{Path(str(model)).name}-tp{tp}-{dtype}{'-tight' if tight else ''}.json"
    cmd = [sys.executable, str(Path(__file__).with_name("tp_tokens.py")), str(model), str(tp), dtype, str(out),
           "--limit", str(limit)] + (["--tight"] if tight else [])
    proc = start(cmd)
    log = output(proc, limit + 20)
    say(f"  {' '.join(cmd[2:6])}: exit {proc.returncode}; {log.strip().splitlines()[-1:] if log.strip() else ''}")
    if proc.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    return {"error": f"exit status {proc.returncode}", "log_tail": log[-6000:]}


def parity(result, args):
    out = result["parity"] = {}
    four_layers = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-4layers-"))
    build_qwen3_0_6b_random(four_layers, num_hidden_layers=4)
    # fp32, default switches (graphs, fused ops, async), small pools: chunked prefill and preemption
    cases = (("tiny-qwen3 fp32", "tiny-qwen3", "float32", True),
             ("0.6B shapes, 4 layers, fp32", four_layers, "float32", True),
             ("qwen3-0.6b-random bf16", SMALL, "bfloat16", False))
    for name, model, dtype, tight in cases:
        one = engine_tokens(model, 1, dtype, tight)
        two = engine_tokens(model, 2, dtype, tight)
        found = out[name] = {"tp1": {k: v for k, v in one.items() if k != "tokens"},
                             "tp2": {k: v for k, v in two.items() if k != "tokens"}}
        if "tokens" in one and "tokens" in two:
            agreeing = [agree(a, b) for a, b in zip(one["tokens"], two["tokens"])]
            found.update(equal_requests=sum(a == b for a, b in zip(one["tokens"], two["tokens"])),
                         of=len(agreeing), agree_before_divergence=agreeing, mean_agreeing=sum(agreeing) / len(agreeing))
        say(f"parity {name}: {found.get('equal_requests')}/{found.get('of')} requests equal; agreeing tokens "
            f"{found.get('agree_before_divergence')}")
        result_saved(result, args)


def bench_process(model, tp, num_requests, out_dir, timeout, one_shot=False):
    """`nanoserve bench` in a fresh process; its JSON, or why there is none."""
    out = Path(out_dir) / f"bench-{model}-tp{tp}{'-one-shot' if one_shot else ''}.json"
    cmd = [sys.executable, "-m", "nanoserve.cli", "bench", "--model", model, "--num-seqs", str(num_requests),
           "--no-baseline", "--out", str(out), "--tensor-parallel-size", str(tp)]
    cmd += ["--custom-all-reduce"] if one_shot else []
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


def bench_pair(result, args, key, model, num_requests, timeout, one_shot_too=False):
    out = result[key] = {}
    variants = [("tp1", 1, False), ("tp2", 2, False)] + ([("tp2_one_shot", 2, True)] if one_shot_too else [])
    for name, tp, one_shot in variants:
        out[name] = bench_process(model, tp, num_requests, args.out_dir, timeout, one_shot)
        result_saved(result, args)
    for name, _, _ in variants[1:]:
        try:
            w1, w2 = out["tp1"]["nanoserve"], out[name]["nanoserve"]
            out[f"throughput_{name}_over_tp1"] = w2["tok_per_s"] / w1["tok_per_s"]
            out.setdefault("bs1_tok_per_s", {"tp1": out["tp1"]["bs1"]["tok_per_s"]})[name] = out[name]["bs1"]["tok_per_s"]
            say(f"{key}: {name}/TP=1 throughput {out[f'throughput_{name}_over_tp1']:.2f}x; batch 1 {out['bs1_tok_per_s']}")
        except KeyError:
            say(f"{key}: a run failed, see its stderr_tail")


def bench8b(result, args):
    bench_pair(result, args, "bench_8b", BIG, args.num_requests, timeout=240, one_shot_too=True)


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


class WideOneShot(OneShotTPGroup):
    max_bytes = 8 << 20  # wide enough to time the one-shot kernel past the engine's cut-off


def graph_us(fn, calls: int, replays: int = 50) -> float:
    """µs per call of fn, recorded `calls` times in one CUDA graph and replayed (no launch cost)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (replays * calls)


def join_fresh_rank(rank, port):
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent holds the store
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    return WideOneShot(rank, 2, torch.bfloat16, torch.device("cuda", rank))


def allreduce_rank(rank, port, sizes, queue):
    """One of two fresh ranks: NCCL's all-reduce and the one-shot one, at each message size."""
    group = join_fresh_rank(rank, port)
    found = {}
    for nbytes in sizes:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(nbytes // 8192, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = x.clone()
        dist.all_reduce(want)
        got = group.all_reduce(x.clone())
        found[nbytes] = {"same_bits_as_nccl": bool(torch.equal(want, got)),
                         "max_abs_diff": (want.float() - got.float()).abs().max().item(),
                         "nccl_us": graph_us(lambda: dist.all_reduce(x), 20),
                         "one_shot_us": graph_us(lambda: group.all_reduce(x), 20)}
    if rank == 0:
        queue.put(found)
    dist.destroy_process_group()


def comm_rank(rank, port, shapes, queue):
    """One of two fresh ranks: replay a decode step's collectives alone (73 all-reduces of [batch,
    hidden] and one all-gather of [batch, vocab / 2]) in a CUDA graph, as the engine replays them;
    with NCCL's all-reduce and with the one-shot one."""
    group = join_fresh_rank(rank, port)
    found = {}
    for batch, hidden, layers, vocab_half in shapes:
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(batch, vocab_half, device="cuda", dtype=torch.bfloat16)
        parts = [torch.empty_like(logits) for _ in range(2)]
        for name, all_reduce in (("nccl", dist.all_reduce), ("one_shot", group.all_reduce)):
            def collectives():
                for _ in range(2 * layers + 1):  # o_proj and down_proj of every layer, and the embedding
                    all_reduce(x)
                dist.all_gather(parts, logits)
            found[f"{name}_batch{batch}"] = graph_us(collectives, 1) / 1000  # ms per step's collectives
    if rank == 0:
        queue.put(found)
    dist.destroy_process_group()


def on_two_fresh_ranks(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # any free port
    procs = [ctx.Process(target=target, args=(r, store.port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    found = queue.get(timeout=180)
    for p in procs:
        p.join(30)
    return found


def allreduce(result, args):
    sizes = [8 << 10, 64 << 10, 512 << 10, 1 << 20, 2 << 20, 8 << 20]
    found = result["allreduce"] = on_two_fresh_ranks(allreduce_rank, sizes)
    for nbytes, f in found.items():
        say(f"all-reduce of {nbytes / 1024:.0f} KiB bf16: NCCL {f['nccl_us']:.1f} µs, one-shot {f['one_shot_us']:.1f} µs;"
            f" same bits as NCCL: {f['same_bits_as_nccl']} (max diff {f['max_abs_diff']:.3g})")


def split(result, args):
    out = result["split_8b_tp2"] = {}
    batches = (1, 64)
    for name, one_shot in (("one_shot", True), ("nccl", False)):
        with LLM(BIG, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=64, async_scheduling=False,
                 custom_all_reduce=one_shot) as llm:
            for b in batches:
                out[f"{name}_step_ms_batch{b}"] = decode_step_ms(llm, b)
                say(f"8B TP=2 ({name}) decode step at batch {b}: {out[f'{name}_step_ms_batch{b}']:.2f} ms")
    comm = on_two_fresh_ranks(comm_rank, [(b, 4096, 36, 151936 // 2) for b in batches])
    for name in ("one_shot", "nccl"):
        for b in batches:
            step, c = out[f"{name}_step_ms_batch{b}"], comm[f"{name}_batch{b}"]
            out[f"{name}_batch{b}"] = {"step_ms": step, "collectives_ms": c, "compute_and_rest_ms": step - c,
                                       "collectives_share": c / step}
            say(f"{name}, batch {b}: step {step:.2f} ms, collectives alone {c:.3f} ms ({c / step:.0%})")


def result_saved(result, args):
    with open(Path(args.out_dir) / "tensor_parallel.json", "w") as f:
        json.dump(result, f, indent=1, default=str)


PHASES = {"prepare": prepare, "allreduce": allreduce, "parity": parity, "bench8b": bench8b, "bench06": bench06,
          "split": split}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--num-requests", type=int, default=128, help="requests of the 8B workload (default 128)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    args = parser.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        sys.exit("tensor_parallel.py needs 2 GPUs")
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
    say(f"done: {Path(args.out_dir) / 'tensor_parallel.json'}")


if __name__ == "__main__":
    main()

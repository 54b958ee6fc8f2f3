"""TP=2 against TP=1 on two GPUs, one stage per process (bench/gpu_tp_smoke.sh STAGE SECONDS runs one with a
hard limit and dumps every process's Python stacks on a hang). Stages: eager, graphs, async (default switches),
tight and tight-eager (fp32, small pool: chunked prefill and preemption; 24 requests x 32 greedy tokens).
bench/results/lesson07/h200x2_tp_smoke.log is its output on two H200s."""
import faulthandler
import sys
import time

faulthandler.dump_traceback_later(float(sys.argv[2]) if len(sys.argv) > 2 else 60, exit=True)
from nanoserve.engine.llm import LLM  # noqa: E402
from nanoserve.engine.sampling_params import SamplingParams  # noqa: E402

STAGES = {"eager": dict(enforce_eager=True), "graphs": dict(enforce_eager=False, async_scheduling=False),
          "async": dict(enforce_eager=False),
          "tight": dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks_override=120),
          "tight-eager": dict(enforce_eager=True, dtype="float32", max_num_seqs=16, max_num_batched_tokens=256,
                              num_gpu_blocks_override=120)}

if __name__ == "__main__":
    args = STAGES[sys.argv[1]]
    t = time.perf_counter()
    print("stage", sys.argv[1], args, flush=True)
    args = {"max_model_len": 1024, "num_gpu_blocks_override": 64, **args}
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **args)
    print(f"built in {time.perf_counter() - t:.1f} s", flush=True)
    import torch
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 300, (24,), generator=gen)]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)
    print("TP=2 done", f"{time.perf_counter() - t:.1f} s; preemptions", llm.engine.stats.preemptions, flush=True)
    ref = LLM("tiny-qwen3", **args)
    out1 = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    print("equal requests", sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(out, out1)), "of", len(out), flush=True)
    llm.shutdown()
    print("shutdown ok", flush=True)

"""`nanoserve bench`: the course's benchmark workload through our engine and through transformers.

The workload is nano-vllm's bench: random.seed(0); 256 requests; prompts of randint(100, 1024) random
token ids in [0, 10000); max_tokens randint(100, 1024); temperature 0.6; ignore_eos; max_model_len 4096;
one warm-up call; throughput = output tokens / wall time.
"""
import contextlib
import dataclasses
import json
import random
import sys
import time

import torch


def workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0):
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def bench_nanoserve(model: str, prompts, max_tokens, max_model_len: int = 4096) -> dict:
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    llm = LLM(model, max_model_len=max_model_len)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up (kernel compiles)
    before = dataclasses.replace(llm.engine.stats)  # the counters before the timed call
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats
    steps, prefill_steps = stats.steps - before.steps, stats.prefill_steps - before.prefill_steps
    pool = llm.cache.block_manager
    return {"engine": "nanoserve (eager)", "seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds,
            "prefill_steps": prefill_steps, "decode_only_steps": steps - prefill_steps,
            "preemptions": stats.preemptions - before.preemptions, "kv_blocks": pool.num_blocks,
            "block_size": pool.block_size}


def bench_transformers(model: str, prompts, max_tokens) -> dict:
    """transformers' batched generate: left-padded, every request runs to the longest max_tokens; only
    each request's own max_tokens count as useful output."""
    import transformers

    from nanoserve.model.zoo import resolve_model

    path = resolve_model(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    kwargs = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(ids[:1, -16:].cuda(), attention_mask=mask[:1, -16:].cuda(), max_new_tokens=8, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(max_tokens),
                    min_new_tokens=max(max_tokens), **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    useful = sum(max_tokens)
    return {"engine": f"transformers {transformers.__version__} batched generate (sdpa, left-padded)",
            "seconds": seconds, "output_tokens": useful, "tok_per_s": useful / seconds}


PHASES = ("schedule", "build metadata", "forward: launch", "forward: wait for the GPU", "sample",
          "output processing")


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """owner.name is `value` inside the block, and what it was after."""
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def profile_steps(engine, num_steps: int) -> dict:
    """Where a step's time goes: milliseconds per step in each phase, over the engine's next num_steps steps.

    The engine's own methods are wrapped with timers meanwhile. On a GPU a synchronize after the forward
    tells its launch (CPU) from its run (the wait); the LM head counts as forward; "output processing" is
    the rest of the step."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    spent = dict.fromkeys(PHASES, 0.0)
    runner = engine.runner

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start
        return wrapper

    def on_the_gpu(fn):  # the model's forward and its LM head
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            launched = time.perf_counter()
            sync()
            spent["forward: launch"] += launched - start
            spent["forward: wait for the GPU"] += time.perf_counter() - launched
            return out
        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(engine.scheduler, "schedule", timed("schedule", engine.scheduler.schedule)))
        stack.enter_context(replaced(runner.builder, "build", timed("build metadata", runner.builder.build)))
        stack.enter_context(replaced(runner, "sampler", timed("sample", runner.sampler)))
        stack.enter_context(replaced(runner.model, "forward", on_the_gpu(runner.model.forward)))
        stack.enter_context(replaced(runner.model, "compute_logits", on_the_gpu(runner.model.compute_logits)))
        sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        sync()
        total = time.perf_counter() - start
    spent["output processing"] = total - sum(spent.values())
    return {"ms_per_step": {phase: 1000 * t / num_steps for phase, t in spent.items()},
            "total_ms_per_step": 1000 * total / num_steps}


def profile_decode(llm, prompts, num_steps: int = 20) -> dict:
    """profile_steps while every prompt decodes together (after their prefills; the requests are dropped after)."""
    from nanoserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    longest = llm.max_model_len - max(map(len, prompts))
    seqs = [engine.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=longest))
            for p in prompts]
    try:
        while True:  # the prefills, until every sequence is in and decoding
            tokens = [token for _, token in engine.step()]
            if not engine.scheduler.waiting and None not in tokens:
                break
        result = profile_steps(engine, num_steps)
    finally:
        for seq in seqs:
            engine.scheduler.abort(seq)
    return {"batch": len(prompts), **result}


def main(model: str, baseline: bool, out: str | None, num_seqs: int, profile: bool = False) -> int:
    if not torch.cuda.is_available() and num_seqs == 256:
        print("nanoserve: bench measures a GPU; on a CPU the full workload would take hours "
              "(try --num-seqs 4 --no-baseline --model tiny-qwen3 to see it run)", file=sys.stderr)
        return 2
    prompts, max_tokens = workload(num_seqs)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens", file=sys.stderr)
    results = {"model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "nanoserve": bench_nanoserve(model, prompts, max_tokens)}
    ours = results["nanoserve"]
    print(f"nanoserve: {ours['output_tokens']:,} tokens in {ours['seconds']:.1f} s = {ours['tok_per_s']:,.0f} tok/s "
          f"({ours['prefill_steps']} steps with prefill, {ours['decode_only_steps']} decode-only, "
          f"{ours['preemptions']} preemptions; KV pool {ours['kv_blocks']:,} blocks of {ours['block_size']})")
    if profile:
        from nanoserve.engine.llm import LLM

        found = results["profile"] = profile_decode(LLM(model, max_model_len=4096), prompts)
        print(f"one decode step at batch {found['batch']}: {found['total_ms_per_step']:.2f} ms")
        for phase, ms in found["ms_per_step"].items():
            print(f"  {phase:26s} {ms:8.2f} ms  {ms / found['total_ms_per_step']:6.1%}")
    if baseline:
        if not torch.cuda.is_available():
            print("nanoserve: the transformers baseline needs a GPU; skipped", file=sys.stderr)
        else:
            theirs = results["transformers"] = bench_transformers(model, prompts, max_tokens)
            results["speedup"] = ours["tok_per_s"] / theirs["tok_per_s"]
            print(f"{theirs['engine']}: {theirs['tok_per_s']:,.0f} useful tok/s ({theirs['seconds']:.1f} s); "
                  f"nanoserve is {results['speedup']:.2f}x")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0

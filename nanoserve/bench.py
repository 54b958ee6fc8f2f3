"""`nanoserve bench`: the course's benchmark workload through our engine and through transformers.

The workload is nano-vllm's bench: random.seed(0); 256 requests; prompts of randint(100, 1024) random
token ids in [0, 10000); max_tokens randint(100, 1024); temperature 0.6; ignore_eos; max_model_len 4096;
one warm-up call; throughput = output tokens / wall time.

`nanoserve bench --features`: what each sampling feature (log-probs, penalties, logit edits, structured
outputs) costs: the workload's throughput when every request asks for one, against the plain workload.
"""
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time

import torch

from nanoserve.engine.sampling_params import SamplingParams, StructuredOutputsParams


def workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0):
    random.seed(seed)
    shortest_in, shortest_out = min(100, max_input_len), min(100, max_output_len)  # 100: nano-vllm's; less if asked
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(shortest_in, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(shortest_out, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


# The stage ladder of lesson 06: the same engine with its speed switches turned on one by one.
STAGES = {"eager (lesson 05)": dict(enforce_eager=True, fused_ops=False, async_scheduling=False),
          "+ CUDA graphs": dict(enforce_eager=False, fused_ops=False, async_scheduling=False),
          "+ fused ops": dict(enforce_eager=False, fused_ops=True, async_scheduling=False),
          "+ async scheduling": dict(enforce_eager=False, fused_ops=True, async_scheduling=True)}


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def bench_nanoserve(llm, prompts, max_tokens) -> dict:
    """The workload through an LLM (warmed up already)."""
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    engine = llm.engine
    before = dataclasses.replace(engine.stats)  # the counters before the timed call
    split = {"prefill": 0.0, "decode": 0.0}  # seconds in steps with prompt tokens, and in decode-only steps

    def step():  # each step ends by reading its tokens on the host, so its time is its own
        start, prefills = time.perf_counter(), engine.stats.prefill_steps
        try:
            return engine_step()
        finally:
            split["prefill" if engine.stats.prefill_steps > prefills else "decode"] += time.perf_counter() - start

    engine_step = engine.step
    with replaced(engine, "step", step):
        seconds, outputs = timed_generate(llm, prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats
    steps, prefill_steps = stats.steps - before.steps, stats.prefill_steps - before.prefill_steps
    pool = llm.cache.block_manager
    return {"seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds,
            "prefill_steps": prefill_steps, "decode_only_steps": steps - prefill_steps,
            "prefill_steps_s": split["prefill"], "decode_steps_s": split["decode"],
            "preemptions": stats.preemptions - before.preemptions, "kv_blocks": pool.num_blocks,
            "block_size": pool.block_size}


def bench_batch1(llm, prompt_len: int = 128, max_tokens: int = 512) -> dict:
    """One request alone: a prompt of prompt_len random ids, max_tokens greedy tokens."""
    prompt = random.Random(1).choices(range(10000), k=prompt_len)
    seconds, outputs = timed_generate(llm, [prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens))
    return {"prompt_tokens": prompt_len, "output_tokens": max_tokens, "seconds": seconds,
            "tok_per_s": max_tokens / seconds}


def graph_replay_ceiling(llm, replays: int = 200) -> float | None:
    """Tokens/s of replaying the batch-1 graph alone (its last step's context): what a batch-1 step could
    cost with no CPU work at all. None without graphs, and with tensor parallelism."""
    runner = llm.engine.runner
    if runner.graphs is None or llm.workers is not None:
        return None  # no graphs; or tensor-parallel ones, whose collectives wait for every rank to replay too
    runner.builder.dev_views["slot_mapping"][:1].fill_(-1)  # replays must not write K/V anywhere
    graph = runner.graphs.graphs[1][0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return replays / (time.perf_counter() - start)


def bench_stage(model: str, prompts, max_tokens, max_model_len: int = 4096, **llm_args) -> dict:
    """Start an LLM with these switches, warm it up, run the workload and the batch-1 decode."""
    from nanoserve.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(model, max_model_len=max_model_len, **llm_args)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up: engine, graphs, compiles
    startup = time.perf_counter() - start
    try:
        result = {"switches": llm_args, "startup_s": startup, "workload": bench_nanoserve(llm, prompts, max_tokens),
                  "bs1": bench_batch1(llm)}
        result["bs1"]["graph_replay_ceiling_tok_per_s"] = graph_replay_ceiling(llm)
        return result
    finally:
        llm.shutdown()


def bench_transformers(model: str, prompts, max_tokens) -> dict:
    """transformers' batched generate: left-padded, every request runs to the longest max_tokens; only
    each request's own max_tokens count as useful output."""
    import transformers

    from nanoserve.model.zoo import resolve_model

    path = resolve_model(model)
    # trust_remote_code=False: a checkpoint's own modelling code (its auto_map) is never imported, as in the loader
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                           trust_remote_code=False).cuda().eval()
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
    (the model and its LM head, eager or a graph's replay) tells its launch (CPU) from its run (the wait);
    "output processing" is the rest of the step. With async scheduling the phases of two steps overlap
    and these times blur: profile with async_scheduling=False (as `nanoserve bench --profile` does)."""
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
        stack.enter_context(replaced(runner, "forward", on_the_gpu(runner.forward)))  # eager or a graph replay
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


def refused_on_cpu(num_seqs: int) -> bool:
    """True (and says why) for the full workload on a CPU: hours of waiting for no useful number."""
    if not torch.cuda.is_available() and num_seqs == 256:
        print("nanoserve: bench measures a GPU; on a CPU the full workload would take hours "
              "(try --num-seqs 4 --no-baseline --model tiny-qwen3 to see it run)", file=sys.stderr)
        return True
    return False


def main(model: str, baseline: bool, out: str | None, num_seqs: int, profile: bool = False,
         ladder: bool = False, tensor_parallel_size: int = 1, custom_all_reduce: bool = False,
         kv_cache_dtype: str = "auto") -> int:
    if refused_on_cpu(num_seqs):
        return 2
    prompts, max_tokens = workload(num_seqs)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens", file=sys.stderr)
    results = {"model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "tensor_parallel_size": tensor_parallel_size,
               "custom_all_reduce": custom_all_reduce, "kv_cache_dtype": kv_cache_dtype}
    settings = {"kv_cache_dtype": kv_cache_dtype}  # what every LLM below gets besides its stage's switches
    if tensor_parallel_size > 1:
        settings["tensor_parallel_size"] = tensor_parallel_size
    if custom_all_reduce:
        settings["custom_all_reduce"] = True
    stages = STAGES if ladder else {"nanoserve": {}}  # {}: the LLM's defaults (graphs and fused ops on a GPU)
    results["ladder"] = {}
    for name, switches in stages.items():
        found = results["ladder"][name] = bench_stage(model, prompts, max_tokens, **switches, **settings)
        w, b = found["workload"], found["bs1"]
        print(f"{name}: {w['output_tokens']:,} tokens in {w['seconds']:.1f} s = {w['tok_per_s']:,.0f} tok/s "
              f"({w['prefill_steps']} steps with prefill, {w['decode_only_steps']} decode-only, {w['preemptions']} "
              f"preemptions; KV pool {w['kv_blocks']:,} blocks of {w['block_size']}); batch 1: {b['tok_per_s']:,.0f} "
              f"tok/s; startup {found['startup_s']:.1f} s")
    last = found  # the last stage is everything on: the engine as `LLM(model)` builds it
    results["nanoserve"], results["bs1"] = last["workload"], last["bs1"]
    if profile:
        from nanoserve.engine.llm import LLM

        # Steps one after another (no async scheduling), so that each phase's time is its own.
        with LLM(model, max_model_len=4096, async_scheduling=False, **settings) as llm:
            found = results["profile"] = profile_decode(llm, prompts)
        print(f"one decode step at batch {found['batch']}: {found['total_ms_per_step']:.2f} ms")
        for phase, ms in found["ms_per_step"].items():
            print(f"  {phase:26s} {ms:8.2f} ms  {ms / found['total_ms_per_step']:6.1%}")
    if baseline:
        if not torch.cuda.is_available():
            print("nanoserve: the transformers baseline needs a GPU; skipped", file=sys.stderr)
        else:
            theirs = results["transformers"] = bench_transformers(model, prompts, max_tokens)
            results["speedup"] = results["nanoserve"]["tok_per_s"] / theirs["tok_per_s"]
            print(f"{theirs['engine']}: {theirs['tok_per_s']:,.0f} useful tok/s ({theirs['seconds']:.1f} s); "
                  f"nanoserve is {results['speedup']:.2f}x")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


# ----------------------------------------------------------------------------
# `nanoserve bench --features`: what each sampling feature costs on the workload

# Each row: the SamplingParams fields that every request of the row adds to the plain workload's. A tuple
# names other rows instead: request i takes the fields of row[i % len(row)] (one batch, features mixed).
FEATURES = {
    "plain": {},
    "logprobs=5": dict(logprobs=5),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "min_p + logit_bias": dict(min_p=0.05, logit_bias={t: -5.0 for t in range(0, 100)}),  # 100 biased tokens
    "json_object": dict(structured_outputs=StructuredOutputsParams(json_object=True)),
    "regex": dict(structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,2000}")),
    "mixed": ("logprobs=5", "penalties", "min_p + logit_bias", "json_object"),  # a quarter of the requests each
}


def feature_fields(row: str, i: int) -> dict:
    """The SamplingParams fields that row adds to request i."""
    spec = FEATURES[row]
    return FEATURES[spec[i % len(spec)]] if isinstance(spec, tuple) else spec


def feature_params(row: str, max_tokens: list[int], cap: int = 256) -> list[SamplingParams]:
    """One SamplingParams per request: the workload's (temperature 0.6, past eos, max_tokens capped at cap), a
    seed per request (request i: seed i) so that a run repeats, and the row's feature."""
    return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=min(m, cap), seed=i, **feature_fields(row, i))
            for i, m in enumerate(max_tokens)]


def warm_up_features(llm) -> None:
    """One small untimed generate with a request of every feature, grammars included. It builds what a process
    builds once: the engine, llguidance's view of the tokenizer, and the compiled constraint of each grammar row
    (cached by the constraint). A user pays that compile once per new constraint, not per request; leaving it
    out of the timed calls makes them measure steady-state throughput."""
    fields = [spec for spec in FEATURES.values() if isinstance(spec, dict)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8, seed=0, **f) for f in fields]
    llm.generate(["Benchmark: "] * len(params), params, use_tqdm=False)


def time_row(llm, prompts, params) -> tuple[dict, list[int]]:
    """One timed generate of the workload with these params: output tokens / wall seconds, and each request's
    output length."""
    seconds, outputs = timed_generate(llm, prompts, params)
    failed = [o.error for o in outputs if o.error]
    if failed:  # a failed request ends early and would make its feature look cheap
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0]}")
    lengths = [sum(len(c.token_ids) for c in o.outputs) for o in outputs]
    return {"seconds": seconds, "output_tokens": sum(lengths), "tok_per_s": sum(lengths) / seconds}, lengths


def same_lengths_twin(llm, prompts, lengths: list[int]) -> dict:
    """The plain workload cut to the lengths a feature's outputs had (a grammar ends an output when it is
    complete): the same tokens without the feature. Its tok/s over a row's is what the feature itself costs;
    the row's tok/s over plain's also counts that a batch whose outputs end early runs fewer rows a step."""
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i) for i, n in enumerate(lengths)]
    return time_row(llm, prompts, params)[0]


def summarize_features(runs: dict) -> dict:
    """Per row: its rounds' tok/s, seconds and output tokens, their median tok/s, and that over plain's."""
    rows = {name: {key: [run[key] for run in found] for key in ("tok_per_s", "seconds", "output_tokens")}
            for name, found in runs.items()}
    for row in rows.values():
        row["median_tok_per_s"] = statistics.median(row["tok_per_s"])
    for name, row in rows.items():
        row["ratio_to_plain"] = row["median_tok_per_s"] / rows["plain"]["median_tok_per_s"]
        twins = [run.get("same_lengths_plain_tok_per_s") for run in runs[name]]
        if any(twins):  # the same tokens, plain, in the same round: the feature's own cost
            row["ratio_to_same_lengths"] = statistics.median(run["tok_per_s"] / twin for run, twin
                                                             in zip(runs[name], twins) if twin)
    return rows


def features_table(rows: dict) -> str:
    """A markdown table of tok/s: feature | round 1 | ... | median | × plain | × plain, same lengths (against
    the plain workload cut to the lengths of the row's outputs, in the same round; "(same)": none ended early)."""
    rounds = len(rows["plain"]["tok_per_s"])
    head = ["feature", *(f"round {r + 1}" for r in range(rounds)), "median", "× plain", "× plain, same lengths"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name, row in rows.items():
        same = row.get("ratio_to_same_lengths")
        same = f"{same:.2f}" if same is not None else \
            "(same)" if row["output_tokens"] == rows["plain"]["output_tokens"] else "not measured"
        cells = [name, *(f"{t:,.0f}" for t in row["tok_per_s"]), f"{row['median_tok_per_s']:,.0f}",
                 f"{row['ratio_to_plain']:.2f}", same]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_features(model: str, out: str | None, num_seqs: int, rounds: int = 2, max_tokens: int = 256,
                   **llm_args) -> int:
    """The workload once per row of FEATURES and round, on one LLM; round 1 runs the rows in order, round 2
    in reverse, and so on, so that drift in the machine falls on every row alike."""
    from nanoserve.engine.llm import LLM

    if refused_on_cpu(num_seqs):
        return 2
    prompts, wanted = workload(num_seqs)
    params = {row: feature_params(row, wanted, max_tokens) for row in FEATURES}
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, at most "
          f"{sum(p.max_tokens for p in params['plain']):,} output tokens per row", file=sys.stderr)
    runs = {row: [] for row in FEATURES}
    # LLM's defaults, prefix caching on: the prompts are computed once, untimed, so that every row finds them
    # in the cache alike, and the rows compare what the features cost, which is in the decoding.
    with LLM(model, max_model_len=4096, **llm_args) as llm:
        warm_up_features(llm)
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        for r in range(rounds):
            for row in list(FEATURES) if r % 2 == 0 else list(FEATURES)[::-1]:
                found, lengths = time_row(llm, prompts, params[row])
                if lengths != [p.max_tokens for p in params[row]]:  # some outputs ended early
                    twin = same_lengths_twin(llm, prompts, lengths)
                    found["same_lengths_plain_tok_per_s"] = twin["tok_per_s"]
                runs[row].append(found)
                print(f"round {r + 1} {row}: {found['output_tokens']:,} tokens in {found['seconds']:.2f} s = "
                      f"{found['tok_per_s']:,.0f} tok/s", file=sys.stderr)
    rows = summarize_features(runs)
    print(f"tok/s, {len(prompts)} requests of the workload, max_tokens capped at {max_tokens}; median of {rounds} "
          f"rounds")
    print(features_table(rows))
    if out:
        results = {"model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "rounds": rounds, "num_seqs": num_seqs, "max_tokens": max_tokens,
                   "llm_args": {"max_model_len": 4096, **llm_args}, "rows": rows}
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0

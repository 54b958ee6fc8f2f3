"""Checks for lesson 06 (CUDA graphs and fused ops), all on a CPU. Oracles: lesson 01's rms_norm and model,
hand-worked graph ladders, and lesson 05's eager engine (the same tokens, padded or not)."""
import torch

from nanoserve.checks.lesson01 import TINY_CONFIGS, _close, hf_tiny_model, ours_from_hf


def check_add_rms_norm(add_rms_norm) -> None:
    from nanoserve.model.qwen3 import rms_norm

    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        x, residual = torch.randn(2, 5, 64, generator=gen).mul(3).to(dtype).unbind(0)
        weight = torch.rand(64, generator=gen).add(0.5).to(dtype)
        got = add_rms_norm(x, residual, weight, 1e-6)
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"add_rms_norm returns (normed, new residual), a tuple of two; got {type(got).__name__}")
        normed, new_residual = got
        if not isinstance(new_residual, torch.Tensor) or not torch.equal(new_residual, x + residual):
            raise AssertionError(f"{dtype}: the second output is the new residual stream, x + residual")
        want = rms_norm(x + residual, weight, 1e-6)
        if dtype == torch.float32 and not (isinstance(normed, torch.Tensor) and torch.equal(normed, want)):
            _close("float32: rms_norm(x + residual)", normed, want, 0.0,
                   "Eagerly it is the same arithmetic as lesson 01, so the same bits: add, then lesson 01's norm.")
        _close(f"{dtype}: rms_norm(x + residual)", normed, want, 2e-2)
        if normed.dtype != dtype:
            raise AssertionError(f"the output keeps the input's dtype ({dtype}), got {normed.dtype}")
    print("✓ add_rms_norm: (rms_norm(x + residual), x + residual), bit-equal to lesson 01 in float32, close in bf16")


def tiny_qwen3_logits(model, prompt_len: int = 12) -> torch.Tensor:
    """Logits of a prompt through a model with lesson 01's NoCache backend."""
    from nanoserve.course.no_cache import NoCache

    ids = torch.arange(prompt_len) * 37 % 1000 + 5
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(prompt_len), NoCache()))


def check_checkpoint_tensors(model_cls, model: str = "tiny-qwen3") -> None:
    from nanoserve.model.loader import load_model
    from nanoserve.model.zoo import resolve_model

    path = resolve_model(model)
    fused = load_model(path, dtype=torch.float32, device="cpu", model_cls=model_cls)
    plain = load_model(path, dtype=torch.float32, device="cpu")
    names, want_names = set(fused.checkpoint_tensors()), set(plain.checkpoint_tensors())
    if names != want_names:
        raise AssertionError(f"checkpoint_tensors names: missing {sorted(want_names - names)[:3]}, unexpected "
                             f"{sorted(names - want_names)[:3]}; they are the checkpoint's names (q_proj, ...)")
    got, want = tiny_qwen3_logits(fused), tiny_qwen3_logits(plain)
    if not torch.equal(got, want):
        _close(f"{model}: fused logits vs lesson 01's model", got, want, 0.0,
               "Are q, k, v the rows [0, q_size), [q_size, q_size + kv_size), the rest? gate the first half of "
               "gate_up_proj, up the second?")
    print(f"✓ checkpoint_tensors: {model} loads into the packed model, whose logits equal lesson 01's (float32)")


def check_graph_sizes(graph_sizes, padded_size) -> None:
    got = graph_sizes(100)
    want = [1, 2, 4, 8] + list(range(16, 100, 16)) + [100]
    if got != want:
        raise AssertionError(f"graph_sizes(100) = {got}, want {want}: 1, 2, 4, 8, multiples of 16, the maximum")
    for largest in (1, 2, 3, 8, 16, 17, 20, 48, 100, 256, 300):
        sizes = graph_sizes(largest)
        if sizes != sorted(set(sizes)) or sizes[-1] != largest:
            raise AssertionError(f"graph_sizes({largest}) = {sizes}: increasing, no repeats, ending at {largest}")
    for sizes in ([1, 2, 4, 8, 16, 32, 48], [3, 7], [5]):
        for n in range(1, sizes[-1] + 3):
            want = min((s for s in sizes if s >= n), default=None)
            if padded_size(n, sizes) != want:
                raise AssertionError(f"padded_size({n}, {sizes}) = {padded_size(n, sizes)}, want {want}: the "
                                     f"smallest size >= n (None when n is larger than every size)")
    print("✓ graph_sizes and padded_size: every batch of 1..max_num_seqs finds the smallest graph that holds it")


class CPUGraph:
    """A CPU stand-in for a recorded CUDA graph, with its contract: recording runs forward once and keeps its
    output; each replay runs forward again, into that same output tensor. Like a CUDA graph, it reads the
    tensors it was recorded over: a graph recorded over anything but the builder's buffers replays stale
    inputs. It saves nothing: on a CPU it checks the bookkeeping around graphs."""

    def __init__(self, forward, pool=None):
        self.forward, self.replays = forward, 0
        self.output = forward()
        self.memory = pool if pool is not None else ("pool", id(self))  # recorded into a pool, or a new one

    def replay(self) -> None:
        self.output.copy_(self.forward())
        self.replays += 1

    def pool(self):
        return self.memory


def cpu_capture(forward, pool):
    """CUDAGraphs.capture on a CPU. Notes each capture: (rows, pool, graph, the model's forward runs since the
    previous capture, or since recording began: a warm-up is one)."""
    warm_ups, cpu_capture.forwards[0] = cpu_capture.forwards[0], 0
    graph = CPUGraph(forward, pool)
    cpu_capture.forwards[0] = 0  # the capture's own run is not a warm-up for the next
    cpu_capture.calls.append((graph.output.shape[0], pool, graph, warm_ups))
    return graph, graph.output


cpu_capture.forwards = [0]


def separate_device_buffer(builder) -> None:
    """A CPU stand-in for a GPU's device buffer: the builder's device tensors become a buffer of their own that
    only builder.copy() refreshes from the host buffer. On a CPU they are the host buffer itself, so a
    forgotten copy would go unseen; on a GPU a graph recorded before the copy reads whatever the device held."""
    builder.dev = builder.hosts[0].clone()
    builder.dev_views = builder._split(builder.dev, builder.dev_views["block_tables"].shape[1])

    def copy():
        builder.dev.copy_(builder.hosts[builder.current])

    builder.copy = copy


def _engine_outputs(engine, requests):
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def check_graphs(graphs_cls) -> None:
    import random

    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.checks import first_difference
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.model_runner import ModelRunner
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.model.qwen3 import Qwen3ForCausalLM

    model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS["qwen3 group=2 head_dim=128"], seed=6))
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    rng = random.Random(6)
    requests = [([rng.randrange(512) for _ in range(rng.randint(1, 12))],
                 SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(2, 10), ignore_eos=True))
                for i in range(7)]
    want = _engine_outputs(LLMEngine(model, PagedKVCache(model.config, num_blocks=64, block_size=4), **args), requests)
    for async_scheduling in (False, True):
        cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
        graphs = graphs_cls(8)
        graphs.capture, cpu_capture.calls = cpu_capture, []  # the CPU stand-in
        runner = ModelRunner(model, cache, args["max_num_seqs"], args["max_num_batched_tokens"], args["max_model_len"],
                             graphs=graphs)
        separate_device_buffer(runner.builder)  # as on a GPU: what the graphs read is there only once copied
        before = cache.k_cache.clone()
        # Every forward of the model embeds its tokens first: count them, whatever path a forward takes.
        counting = model.model.embed_tokens.register_forward_pre_hook(
            lambda module, args: cpu_capture.forwards.__setitem__(0, cpu_capture.forwards[0] + 1))
        cpu_capture.forwards[0] = 0
        try:
            graphs.record(runner)
        finally:
            counting.remove()
        if sorted(graphs.graphs) != graphs.sizes:
            raise AssertionError(f"recorded sizes {sorted(graphs.graphs)}, want one graph per size {graphs.sizes}")
        if not torch.equal(cache.k_cache, before):
            raise AssertionError("recording wrote K/V into the pool: record with every row padding (slot -1), "
                                 "and copy the builder's buffer to the device before recording")
        rows = [n for n, _, _, _ in cpu_capture.calls]
        if rows != sorted(rows, reverse=True):
            raise AssertionError(f"graphs recorded for {rows} rows, in this order: record the largest first, so "
                                 f"that the smaller ones fit in its memory pool")
        first = cpu_capture.calls[0][2]
        if cpu_capture.calls[0][1] is not None or any(p != first.pool() for _, p, _, _ in cpu_capture.calls[1:]):
            raise AssertionError(f"memory pools passed to capture: {[p for _, p, _, _ in cpu_capture.calls]}; the "
                                 f"first (largest) graph gets None, every later one the first graph's pool()")
        cold = [n for n, _, _, runs in cpu_capture.calls if not runs]
        if cold:
            raise AssertionError(f"the graphs of {cold} rows were captured with no forward run before them: run "
                                 f"forward once outside the graph (a warm-up) before each capture. On a GPU that run "
                                 f"compiles kernels and settles the allocator, which a capture cannot do")
        got = _engine_outputs(LLMEngine(model, cache, **args, runner=runner, async_scheduling=async_scheduling),
                              requests)
        replays = {size: graph.replays for size, (graph, _) in graphs.graphs.items()}
        if got != want:
            i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise AssertionError(f"request {i} through the graphs (async scheduling {async_scheduling}): "
                                 f"{first_difference(got[i], want[i], 'token')} (want: eager). Record over "
                                 f"builder.static(size, ...) (the buffers every step refills), and pad every row "
                                 f"before recording")
        if not (replays[4] and replays[8]):
            raise AssertionError(f"replays per graph size {replays}: the padded graphs did not run")
    print(f"✓ record: one graph per size, recorded over the builder's buffers without writing K/V; 7 requests "
          f"through padded replays {replays} give the eager engine's tokens, with and without async scheduling")


def workload_roofline(bandwidth: float = 4.3e12) -> dict:
    """Lesson 05's roofline of the benchmark workload's decode steps on one H200 with Qwen3-0.6B (bf16):
    every step reads all the weights once, every running request its whole context's K/V once."""
    from nanoserve.bench import workload

    hidden, layers, q_size, kv_size, inter, vocab = 1024, 28, 16 * 128, 8 * 128, 3072, 151936  # Qwen3-0.6B
    params = vocab * hidden + layers * (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter)
    weight_bytes, kv_bytes_per_token = 2 * params, 2 * layers * kv_size * 2
    prompts, max_tokens = workload()
    kv_read = weight_read = 0
    for step in range(max(max_tokens) - 1):  # the first token of each request comes from its prefill
        contexts = [len(p) + 1 + step for p, m in zip(prompts, max_tokens) if step < m - 1]
        kv_read += kv_bytes_per_token * sum(contexts)
        weight_read += weight_bytes
    seconds = (kv_read + weight_read) / bandwidth
    return {"kv_bytes": kv_read, "weight_bytes": weight_read, "bytes": kv_read + weight_read, "seconds": seconds,
            "output_tokens": sum(max_tokens), "tok_per_s": sum(max_tokens) / seconds, "bandwidth": bandwidth,
            "weight_bytes_per_step": weight_bytes}


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
def e4m3_cases() -> dict[str, torch.Tensor]:
    """Values the hint names, by kind, plus random ones of every size: float32, both signs."""
    gen = torch.Generator().manual_seed(65)
    normal = torch.arange(-6, 9, dtype=torch.float32)  # e4m3's normal exponents: 2**-6 .. 2**8
    # halfway between two neighbours, 1.mmm and 1.mmm + 1/8, in every binade: ties go to the even mantissa
    ties = ((1 + (torch.arange(7) + 0.5) / 8)[None, :] * torch.exp2(normal[:-1])[:, None]).flatten()
    cases = {
        "zero and the exact values 1, 1.125, 448": torch.tensor([0.0, 1.0, 1.125, 448.0, 2.0**-6, 0.875 * 2**-6]),
        "ties (exactly halfway between two e4m3 values)": ties,
        "subnormals (below 2**-6, where the spacing stays 2**-9)": torch.tensor(
            [2.0**-7, 3 * 2.0**-10, 5 * 2.0**-11, 2.0**-10, 0.6 * 2**-10, 2.0**-12, 7.4 * 2**-10]),
        "past the largest value (448): saturated, not NaN": torch.tensor([449.0, 463.9, 464.0, 480.0, 1e4, 3e38]),
        "random values from 2**-12 to 2**10": torch.randn(20_000, generator=gen) * torch.exp2(
            torch.rand(20_000, generator=gen) * 22 - 12),
    }
    return {name: torch.cat([x, -x]) for name, x in cases.items()}


def check_round_to_e4m3(round_to_e4m3) -> None:
    from nanoserve.kernels.paged import to_cache_dtype

    for name, x in e4m3_cases().items():
        got = round_to_e4m3(x.clone())
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise AssertionError(f"round_to_e4m3 returns a tensor of x's shape {tuple(x.shape)}, got "
                                 f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}")
        want = to_cache_dtype(x, torch.float8_e4m3fn).float()  # torch's cast of the clamped values
        wrong = (got.float() != want) & ~(got.float().isnan() & want.isnan())
        if wrong.any():
            i = int(wrong.nonzero()[0])
            raise AssertionError(f"{name}: round_to_e4m3({x[i].item()!r}) gave {got[i].item()!r}, e4m3 holds "
                                 f"{want[i].item()!r} ({int(wrong.sum())} of {len(x)} values differ)")
    print("✓ round_to_e4m3: torch's float8 e4m3 cast bit for bit, ties to even, subnormals, saturation at 448")


EXERCISES = {
    "6.1 add_rms_norm": lambda ns: check_add_rms_norm(ns["add_rms_norm"]),
    "6.2 checkpoint_tensors": lambda ns: check_checkpoint_tensors(ns["FusedQwen3ForCausalLM"]),
    "6.3 graph_sizes": lambda ns: check_graph_sizes(ns["graph_sizes"], ns["padded_size"]),
    "6.4 record": lambda ns: check_graphs(ns["CUDAGraphs"]),
    "6.5 round_to_e4m3": lambda ns: check_round_to_e4m3(ns["round_to_e4m3"]),
}

"""vLLM's `vllm.v1.metrics.reader`: the metric objects LLM.get_metrics() returns, with vLLM's names and fields.

vLLM reads them back from its Prometheus registry; here they are made straight from what the LLM keeps
(stats.py) and from the engine's state at the moment of the call, so no registry is involved:

- gauges, read now: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc;
- counters over the LLM's life: vllm:prompt_tokens, vllm:generation_tokens, vllm:request_success (by
  finished_reason), vllm:prefix_cache_queries and vllm:prefix_cache_hits (in tokens), vllm:num_preemptions;
- histograms: vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds, vllm:request_prompt_tokens,
  vllm:request_generation_tokens.
Every metric carries vLLM's labels, model_name and engine ("0": one engine per LLM).
"""
from dataclasses import dataclass


@dataclass
class Metric:
    """One metric's value under one set of labels (a name may come with several, e.g. one per finish reason)."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """Only goes up, over the LLM's life."""
    value: int


@dataclass
class Vector(Metric):
    """An ordered list of counters. vLLM has one, for speculative decoding (which nanoserve does not do): no
    metric here is a Vector; the class is here for scripts that test for it."""
    values: list[int]


@dataclass
class Gauge(Metric):
    """A value read at the moment of the call."""
    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets, as Prometheus keeps them: buckets maps each bucket's upper edge (as text, "+Inf"
    last) to the observations at or below it (cumulative); count is the "+Inf" bucket's, sum their total."""
    count: int
    sum: float
    buckets: dict[str, int]


def snapshot(llm) -> list[Metric]:
    """LLM.get_metrics(): every metric of this LLM, now."""
    stats = llm.stats
    if stats is None:
        raise RuntimeError("get_metrics: this LLM keeps no metrics: make it with LLM(..., disable_log_stats=False) "
                           "(as vLLM's, True is the default)")
    labels = {"model_name": str(llm.args.model), "engine": "0"}
    engine = llm._engine  # None until the first request: nothing has run
    running = waiting = usage = preemptions = 0
    if engine is not None:
        pool = engine.cache.block_manager
        running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
        usage = 1 - pool.num_free / pool.num_blocks  # cached blocks no request holds count as free, as vLLM's
        preemptions = engine.stats.preemptions
    out: list[Metric] = [Gauge("vllm:num_requests_running", labels, running),
                         Gauge("vllm:num_requests_waiting", labels, waiting),
                         Gauge("vllm:kv_cache_usage_perc", labels, usage)]
    counts = {**stats.counters, "vllm:num_preemptions": preemptions}
    out += [Counter(name, labels, value) for name, value in counts.items()]
    out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, value)
            for reason, value in stats.finished.items()]
    for name, hist in stats.histograms.items():
        running_total, buckets = 0, {}
        for edge, n in zip([*map(str, hist.edges), "+Inf"], hist.counts):
            running_total += n
            buckets[edge] = running_total
        out.append(Histogram(name, labels, running_total, hist.sum, buckets))
    return out

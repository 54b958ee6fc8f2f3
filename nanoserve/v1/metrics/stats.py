"""What LLM(disable_log_stats=False) keeps for get_metrics: vLLM's request counters and histograms, over the
requests of the LLM's own calls (generate, chat, stream; a server keeps its own, nanoserve/serve/metrics.py).

It costs a plain LLM nothing: only an LLM made with disable_log_stats=False makes a RequestStats, whose
watch() replaces the deque a call's deltas are routed to by one that looks at each delta on its way in.
Each completion of a request (n > 1) is counted as a request of its own, as vLLM's engine counts a request's
n children. The times are the engine's own (Sequence.arrival_time, first_scheduled_time, last_token_time).
"""
import weakref
from bisect import bisect_left
from collections import deque

# vLLM's bucket edges: seconds to the first token, between two tokens, and of a request's whole life
TTFT_EDGES = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_EDGES = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)
REQUEST_EDGES = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


def one_two_five(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to largest (vLLM's edges for token counts, up to max_model_len)."""
    edges, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > largest:
                return tuple(float(e) for e in edges)
            edges.append(step * scale)
        scale *= 10


class Buckets:
    """A histogram's state: counts per bucket (the last one past every edge), and the observations' sum."""

    def __init__(self, edges: tuple[float, ...]):
        self.edges, self.counts, self.sum = edges, [0] * (len(edges) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.edges, value)] += 1  # the first edge >= value: Prometheus's "le"
        self.sum += value


class RequestStats:
    def __init__(self, max_model_len: int):
        self.counters = dict.fromkeys(("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
                                       "vllm:prefix_cache_hits"), 0)
        self.finished = dict.fromkeys(("stop", "length", "error"), 0)  # vllm:request_success, by finished_reason
        tokens = one_two_five(max_model_len)
        self.histograms = {"vllm:time_to_first_token_seconds": Buckets(TTFT_EDGES),
                           "vllm:inter_token_latency_seconds": Buckets(ITL_EDGES),
                           "vllm:e2e_request_latency_seconds": Buckets(REQUEST_EDGES),
                           "vllm:request_queue_time_seconds": Buckets(REQUEST_EDGES),
                           "vllm:request_prompt_tokens": Buckets(tokens),
                           "vllm:request_generation_tokens": Buckets(tokens)}
        # sequence -> when its last token came; a sequence dropped unfinished (a stream its caller left) leaves
        self.last_token = weakref.WeakKeyDictionary()

    def watch(self) -> "Watched":
        """A call's delta queue that counts what passes through it."""
        return Watched(self)

    def observe(self, delta) -> None:
        seq, h, c = delta.seq, self.histograms, self.counters
        if delta.token_id is None:  # it failed alone
            self.finished["error"] += 1
            self.last_token.pop(seq, None)
            return
        now, before = seq.last_token_time, self.last_token.get(seq)
        if before is None:  # its first token
            h["vllm:time_to_first_token_seconds"].observe(seq.first_token_time - seq.arrival_time)
            h["vllm:request_queue_time_seconds"].observe(seq.first_scheduled_time - seq.arrival_time)
            h["vllm:request_prompt_tokens"].observe(seq.num_prompt_tokens)
            c["vllm:prompt_tokens"] += seq.num_prompt_tokens
            if seq.index == 0:  # the completion that looked the prompt up (the others start from its blocks)
                c["vllm:prefix_cache_queries"] += seq.num_prompt_tokens
                c["vllm:prefix_cache_hits"] += seq.num_cached_tokens
        else:
            h["vllm:inter_token_latency_seconds"].observe(now - before)
        c["vllm:generation_tokens"] += 1
        if delta.finish_reason is None:
            self.last_token[seq] = now
            return
        self.last_token.pop(seq, None)
        self.finished[delta.finish_reason] = self.finished.get(delta.finish_reason, 0) + 1
        h["vllm:e2e_request_latency_seconds"].observe(now - seq.arrival_time)
        h["vllm:request_generation_tokens"].observe(seq.num_output_tokens)


class Watched(deque):
    """A deque of deltas that shows each one to the stats as it is appended (by the LLM's OutputRouter)."""

    def __init__(self, stats: RequestStats):
        super().__init__()
        self.stats = stats

    def append(self, delta) -> None:
        self.stats.observe(delta)
        super().append(delta)

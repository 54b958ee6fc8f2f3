"""The server's Prometheus metrics, named as vLLM's (vllm:... becomes nanoserve:...).

Each server gets its own CollectorRegistry, not prometheus_client's global one: two servers in one
process (tests) then never share or collide on a counter.
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges in seconds: from a fast GPU token (ms) to a long CPU queue (tens of seconds).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def make(kind, name, doc, **kwargs):
            return kind(f"nanoserve:{name}", doc, list(labels), registry=self.registry, **kwargs).labels(**labels)

        self.num_requests_running = make(Gauge, "num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be admitted")
        self.kv_cache_usage_perc = make(Gauge, "kv_cache_usage_perc",
                                        "Share of KV blocks held by requests (0-1); cached free blocks not counted")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens")
        self.time_to_first_token = make(Histogram, "time_to_first_token_seconds",
                                        "From arrival to the request's first token", buckets=LATENCY_BUCKETS)
        self.inter_token_latency = make(Histogram, "inter_token_latency_seconds",
                                        "Between two tokens of one completion", buckets=LATENCY_BUCKETS)
        self.e2e_request_latency = make(Histogram, "e2e_request_latency_seconds",
                                        "From arrival to the request's last token", buckets=LATENCY_BUCKETS)
        self.request_success = Counter("nanoserve:request_success", "Requests that finished, by finish reason",
                                       [*labels, "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def request_finished(self, seconds: float, finish_reason: str) -> None:
        self.e2e_request_latency.observe(seconds)
        self.request_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text format, for GET /metrics."""
        return generate_latest(self.registry)

"""A serving benchmark, like `vllm bench serve`: requests arrive as a Poisson process at a given rate,
each one streams its answer, and we time what a user feels.

    TTFT  time to first token: from sending the request to the first piece of text
    ITL   inter-token latency: the gaps between pieces of text of one request
    TPOT  time per output token: (latency - TTFT) / (output tokens - 1), one number per request

It talks plain HTTP (httpx) to any OpenAI-compatible server, so it measures nanoserve, vLLM or
`transformers serve` alike. At rate `inf` every request is sent at once: the server's throughput.
"""
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def course_requests(tokenizer, num_prompts: int, max_input_len: int, max_output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """The course workload (nanoserve.bench.workload): random token ids as prompts, decoded to text
    so that any server can take them (re-encoding may change a prompt's length a little)."""
    from nanoserve.bench import workload

    prompts, max_tokens = workload(num_prompts, max_input_len, max_output_len, seed)
    return [BenchRequest(tokenizer.decode(ids), m) for ids, m in zip(prompts, max_tokens)]


def file_requests(path: str) -> list[BenchRequest]:
    """A JSON list of {"prompt": str, "max_tokens": int}."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("prompt"), str) and isinstance(i.get("max_tokens"), int)
            for i in items):
        raise ValueError(f"{path}: expected a JSON list of {{\"prompt\": str, \"max_tokens\": int}}")
    return [BenchRequest(i["prompt"], i["max_tokens"]) for i in items]


def request_body(request: BenchRequest, model: str, endpoint: str, extra: dict) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "stream": True, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def chunk_text(event: dict, endpoint: str) -> str:
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict, endpoint: str, tokenizer) -> RequestResult:
    """One streamed request, timed chunk by chunk."""
    start = time.perf_counter()
    times, text, usage = [], [], None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestResult(False, error=str(event["error"]))
                usage = event.get("usage") or usage
                piece = chunk_text(event, endpoint)
                if piece:
                    times.append(time.perf_counter())
                    text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    if not times:
        return RequestResult(False, error="no text came back")
    # The server's own count when it gives one (stream_options.include_usage), else the text re-encoded.
    tokens = usage["completion_tokens"] if usage else len(tokenizer.encode("".join(text), add_special_tokens=False))
    return RequestResult(True, times[-1] - start, times[0] - start, list(np.diff(times)), tokens)


async def run_at_rate(base_url: str, model: str, requests: list[BenchRequest], rate: float, endpoint: str,
                      extra: dict, tokenizer, api_key: str | None = None, seed: int = 0) -> dict:
    """Send every request, spaced by exponential gaps of mean 1/rate (all at once if rate is inf)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gaps = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            body = request_body(request, model, endpoint, extra)
            tasks.append(asyncio.create_task(send(client, path, body, endpoint, tokenizer)))
            if rate != float("inf"):
                await asyncio.sleep(gaps.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate)


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict:
    done = [r for r in results if r.ok]
    ms = lambda values: {"median_ms": float(np.median(values)) * 1e3 if values else None,
                         "p99_ms": float(np.percentile(values, 99)) * 1e3 if values else None}
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    return {"request_rate": "inf" if rate == float("inf") else rate, "completed": len(done),
            "failed": len(results) - len(done), "errors": sorted({r.error for r in results if not r.ok})[:5],
            "duration_s": duration, "request_throughput": len(done) / duration,
            "output_throughput": output_tokens / duration, "output_tokens": output_tokens,
            "ttft": ms([r.ttft for r in done]), "tpot": ms(tpot), "itl": ms([g for r in done for g in r.itl])}


def print_summary(s: dict) -> None:
    print(f"rate {s['request_rate']}: {s['completed']} done, {s['failed']} failed in {s['duration_s']:.1f} s; "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s")
    for name in ("ttft", "tpot", "itl"):
        m = s[name]
        if m["median_ms"] is not None:
            print(f"  {name.upper():5s} median {m['median_ms']:9.1f} ms   p99 {m['p99_ms']:9.1f} ms")
    for error in s["errors"]:
        print(f"  error: {error}")


def plot_latency(runs: dict[str, list[dict]], path: str) -> None:
    """TTFT and TPOT (median, p99) against the request rate, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, summaries in runs.items():
        rates = [str(s["request_rate"]) for s in summaries]
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for stat, style in (("median_ms", "o-"), ("p99_ms", "x--")):
                ax.plot(rates, [s[metric][stat] for s in summaries], style, label=f"{label} {stat[:-3]}")
        axes[2].plot(rates, [s["output_throughput"] for s in summaries], "o-", label=label)
    for ax, title in zip(axes, ("time to first token (ms)", "time per output token (ms)", "output tok/s")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The fields sent with every request: the workload's temperature; nanoserve's and vLLM's ignore_eos (exactly
# max_tokens tokens); and the server's own token count. Servers that reject unknown fields get less.
DEFAULT_EXTRA_BODY = '{"temperature": 0.6, "ignore_eos": true, "stream_options": {"include_usage": true}}'


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 or inf, got {text}")
    return rate


def main(args) -> int:
    """`nanoserve bench-serve`: one run per rate; JSON and a plot if asked."""
    from nanoserve.model.loader import load_tokenizer
    from nanoserve.model.zoo import resolve_model

    rates = [parse_rate(r) for r in args.request_rate]
    tokenizer = load_tokenizer(resolve_model(args.tokenizer or args.model))
    requests = file_requests(args.dataset) if args.dataset else course_requests(
        tokenizer, args.num_prompts, args.max_input_len, args.max_output_len, args.seed)
    extra = json.loads(args.extra_body or DEFAULT_EXTRA_BODY)
    summaries = []
    for rate in rates:
        summary = asyncio.run(run_at_rate(args.base_url, args.model, requests, rate, args.endpoint, extra, tokenizer,
                                          args.api_key, args.seed))
        print_summary(summary)
        summaries.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
                       "num_requests": len(requests), "runs": summaries}, f, indent=2)
    if args.plot:
        plot_latency({args.model: summaries}, args.plot)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1

"""The `nanoserve` command line.

    nanoserve generate "Once upon a time" [--model NAME_OR_DIR] [--max-tokens N]
                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--chat] [--device cpu|cuda[:N]]
                       [--tensor-parallel-size N]
    nanoserve prepare tiny-qwen3 smollm2-135m-instruct
    nanoserve serve MODEL [--host H] [--port P] [--api-key KEY] [--max-model-len N] [--max-num-seqs N] ...
    nanoserve bench-serve --base-url URL --model NAME [--request-rate R ...] [--num-prompts N] [--out FILE]
    nanoserve bench [--model NAME_OR_DIR] [--num-seqs N] [--no-baseline] [--out FILE] [--profile] [--ladder]
                    [--tensor-parallel-size N] [--custom-all-reduce]
    nanoserve bench --features [--model NAME_OR_DIR] [--num-seqs N] [--rounds R] [--max-tokens N] [--out FILE]

    nanoserve --debug SUBCOMMAND ...   (--debug goes before the subcommand: show the full traceback of an error)

Exit status: 0 on success; 1 on an error (`nanoserve: <message>` on stderr: an unknown or broken model, a bad
device, a prompt that is not UTF-8, a failed request, a file that cannot be read or written); 2 on a usage error
(an unknown flag, a bad flag value); 130 on Ctrl-C (`nanoserve: interrupted`).
"""
import argparse
import os
import random
import sys
import time
import traceback

# The errors a user can cause (a bad model, device, prompt or file) or meet (out of memory): one line, exit 1.
# Anything else is a bug in nanoserve and keeps its traceback.
EXPECTED_ERRORS = (ValueError, NotImplementedError, RuntimeError, OSError)  # OSError covers FileNotFoundError


class UsageError(ValueError):
    """A bad flag value found after argparse (exit 2, like argparse's own usage errors)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _model_len(text: str) -> int:
    """vLLM's --max-model-len: an integer, or with a suffix: 2k = 2000, 2K = 2048 (m/M: 10**6 / 2**20)."""
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 2**20}.get(text[-1:], 1)
    try:
        value = round(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, or one like 2k (2000) or 2K (2048), got {text!r}") from None
    return _positive_int(str(value))


def _kv_cache_dtype(text: str) -> str:
    """vLLM's --kv-cache-dtype: auto (the model's dtype), bfloat16, or fp8 / fp8_e4m3 (lesson 06)."""
    from nanoserve.engine.engine_args import KV_CACHE_DTYPES

    if text != "auto" and text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"one of auto, {', '.join(KV_CACHE_DTYPES)}; got {text!r}")
    return text


class _Refused(argparse.Action):
    """A vLLM flag nanoserve does not take: a usage error that says why, rather than a flag that is ignored."""

    def __init__(self, option_strings, dest, why: str, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A Qwen3 inference engine built in notebooks.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (goes before the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a completion of a prompt")
    gen.add_argument("prompt", help="the text to complete (with --chat: the user's message)")
    gen.add_argument("--model", default=None,
                     help="a model directory, a hub id in the local HF cache, or one of tiny-qwen3, qwen3-0.6b-random, "
                          "qwen3-8b-random, smollm2-135m-instruct (default: a cached Qwen3, else SmolLM2)")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="0 = greedy (default); higher = more random")
    gen.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample only from the smallest set of tokens "
                                                               "whose probability reaches p (default 1 = all)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling, for reproducible output")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through LLM.chat "
                                                         "(the model's chat template)")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    gen.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                     help="split the model over N processes (GPUs 0..N-1, or the CPU) (default 1)")
    bench = sub.add_parser("bench", help="the course's benchmark workload (GPU), against transformers")
    bench.add_argument("--model", default="qwen3-0.6b-random")
    bench.add_argument("--num-seqs", type=_positive_int, default=256)
    bench.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                       help="run nanoserve split over N GPUs (default 1)")
    bench.add_argument("--custom-all-reduce", action="store_true",
                       help="with tensor parallelism, small all-reduces by the one-shot kernel (lesson 07)")
    bench.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto",
                       help="the KV cache's: auto (the model's dtype), bfloat16, fp8 or fp8_e4m3")
    bench.add_argument("--out", default=None, help="also write the results as JSON here")
    bench.add_argument("--profile", action="store_true",
                       help="also show where one decode step's time goes, with every request decoding")
    bench.add_argument("--ladder", action="store_true",
                       help="measure lesson 06's stages one by one: eager, + CUDA graphs, + fused ops, "
                            "+ async scheduling")
    bench.add_argument("--features", action="store_true",
                       help="the cost of each sampling feature (log-probs, penalties, logit edits, structured "
                            "outputs): the workload with every request asking for one, against the plain workload; "
                            "no transformers baseline")
    # None: not given (a usage error without --features, rather than a flag that is ignored)
    bench.add_argument("--rounds", type=_positive_int, default=None, metavar="R",
                       help="with --features: rounds, alternating the rows' order (default 2)")
    bench.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                       help="with --features: each request's max_tokens capped at N (default 256)")
    add_serve_parser(sub)
    add_bench_serve_parser(sub)
    prep = sub.add_parser("prepare", help="build or find models now, so later runs start at once")
    prep.add_argument("models", nargs="+", help="model names, hub ids or directories")
    return parser


# How `nanoserve serve`'s engine flags differ from EngineArgs.add_cli_args's own (a flag for every EngineArgs
# setting, with its default): vLLM's checks, aliases and server defaults, help, and the settings a server leaves out.
SERVE_ENGINE_FLAGS = {
    "model": None,  # serve's positional argument
    "profiler_config": None,  # the server has no start_profile route
    "disable_log_stats": None,  # --disable-log-stats: below, with --disable-log-requests
    "max_model_len": dict(type=_model_len, help="tokens, or like 2k / 2K (default %(default)s)"),
    "max_num_seqs": dict(type=_positive_int),
    "max_num_batched_tokens": dict(type=_positive_int, default=8192,
                                   help="tokens per step (default 8192, below LLM's 16384: a shorter step keeps "
                                        "TTFT and ITL down)"),
    "block_size": dict(type=_positive_int),
    "tensor_parallel_size": dict(type=_positive_int, aliases=["-tp"]),
    "num_gpu_blocks_override": dict(type=_positive_int),
    "max_logprobs": dict(type=_non_negative_int, help="the most log-probs a request may ask for per token; more get "
                                                      "HTTP 400 (default %(default)s)"),
    "kv_cache_dtype": dict(type=_kv_cache_dtype, help="the KV cache's: auto (the model's dtype), bfloat16, fp8 or "
                                                      "fp8_e4m3 (e4m3, scale 1.0)"),
    "dtype": dict(help="auto, bfloat16, float16 or float32 (default auto: the checkpoint's on a GPU, float32 on "
                       "a CPU)"),
    "enforce_eager": dict(help="no CUDA graphs, no torch.compile (default: eager on a CPU only)"),
    "custom_all_reduce": dict(help="with tensor parallelism, small all-reduces by the one-shot kernel (lesson 07)"),
    "async_scheduling": dict(help="schedule step N+1 while step N runs (default: on unless eager)"),
    "fused_ops": dict(help="lesson 06's fused model (--no-fused-ops: lesson 01's)"),
    "cpu_kv_cache_gib": dict(help="the KV pool's memory on a CPU, in GiB (default %(default)s)"),
    "seed": dict(help="seeds the requests that bring none (default %(default)s)"),
    "tokenizer": dict(help="a tokenizer directory or zoo name of its own (default: the model's); no remote code"),
    "generation_config": dict(help="sampling defaults: auto (the checkpoint's generation_config.json), vllm (none) "
                                   "or a folder"),
    "device": dict(help="cpu, cuda or cuda:N (default: cuda if available)"),
    "trust_remote_code": dict(action=_Refused, help="refused: nanoserve never runs a checkpoint's own code",
                              why="nanoserve never runs a checkpoint's own code (tokenizers load without it)"),
}


def add_serve_parser(sub) -> None:
    """`nanoserve serve MODEL`: the engine's flags from EngineArgs (as vLLM's), and the server's own."""
    from nanoserve.engine.engine_args import EngineArgs

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (like vllm serve)")
    serve.add_argument("model", help="a model directory, a hub id in the local HF cache, or a zoo name")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health, /ping, /version and "
                            "/metrics (default: $VLLM_API_KEY, as vLLM's)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model's name in the API (default: MODEL); one name only so far")
    serve.add_argument("--max-waiting-requests", type=_positive_int, default=256,
                       help="requests that may wait beyond the running batch; more get HTTP 503 (default 256)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (rendered in transformers' sandbox)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file, or the template itself) in place of the model's")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries X-Request-Id (the client's, or one made for it)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="log-probs name their tokens 'token_id:N' unless a request says otherwise")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, as with stream_options.include_usage")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens (the prompt's tokens found cached)")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load counts the generation requests being served")
    serve.add_argument("--enable-per-request-metrics", action="store_true",
                       help="a response carries its request's timings as metrics (a stream: on its usage chunk)")
    serve.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves the API under (every route answers with it and without)")
    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="put a chat answer's thinking apart from its content (message.reasoning): qwen3 "
                            "(<think> ... </think>); with it, the chat template's thinking is on by default")
    serve.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1, metavar="N",
                       help="N replicas of the engine (each on GPUs of its own), behind vllm-router on --host and "
                            "--port (pip install vllm-router)")
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.add_argument("--disable-log-requests", "--disable-log-stats", action="store_true",
                       help="accepted for vLLM's scripts: nanoserve logs neither requests nor periodic stats")
    EngineArgs.add_cli_args(serve, SERVE_ENGINE_FLAGS)
    serve.add_argument("--disable-custom-all-reduce", action="store_false", dest="custom_all_reduce",
                       help="NCCL's all-reduce only (the default here; vLLM's flag)")


def add_bench_serve_parser(sub) -> None:
    """`nanoserve bench-serve`: the serving benchmark against any OpenAI-compatible server."""
    bench = sub.add_parser("bench-serve", help="benchmark a running OpenAI-compatible server (like vllm bench serve)")
    bench.add_argument("--base-url", default=None, help="the server, without /v1 (default: http://HOST:PORT)")
    bench.add_argument("--host", default="127.0.0.1")
    bench.add_argument("--port", type=int, default=8000)
    bench.add_argument("--model", required=True, help="the model name the server expects")
    bench.add_argument("--tokenizer", default=None,
                       help="the model whose tokenizer turns workload token ids into text (default: --model)")
    bench.add_argument("--endpoint", default="completions",
                       help="completions or chat (or vLLM's paths: /v1/completions, /v1/chat/completions)")
    bench.add_argument("--backend", choices=["vllm", "openai", "openai-chat"], default=None,
                       help="vLLM's: openai-chat is --endpoint chat; vllm and openai are completions")
    bench.add_argument("--request-rate", nargs="+", default=["inf"],
                       help="requests per second (Poisson arrivals), or inf; several rates run one after another")
    bench.add_argument("--max-concurrency", type=_positive_int, default=None,
                       help="at most this many requests in flight (default: no limit)")
    bench.add_argument("--num-prompts", type=_positive_int, default=64)
    bench.add_argument("--dataset-name", choices=["course", "random", "custom"], default="course",
                       help="course: the course workload (--max-input-len, --max-output-len); random: vLLM's random "
                            "prompts (--random-input-len, --random-output-len, --random-range-ratio); custom: "
                            "--dataset-path")
    bench.add_argument("--max-input-len", type=_positive_int, default=1024)
    bench.add_argument("--max-output-len", type=_positive_int, default=1024)
    bench.add_argument("--random-input-len", type=_positive_int, default=1024)
    bench.add_argument("--random-output-len", type=_positive_int, default=128)
    bench.add_argument("--random-range-ratio", type=float, default=0.0)
    bench.add_argument("--dataset", "--dataset-path", dest="dataset", default=None,
                       help="a JSON list of {\"prompt\": str, \"max_tokens\": int} instead of the course workload")
    bench.add_argument("--extra-body", default=None,
                       help="JSON fields sent with every request (default: temperature 0.6, ignore_eos, "
                            "stream_options.include_usage; give '{\"temperature\": 0.6}' to a server that rejects extras)")
    bench.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (on by default here)")
    bench.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                       help="the latencies to report: a comma-separated list of ttft, tpot, itl, e2el")
    bench.add_argument("--metric-percentiles", default="99", help="their percentiles, besides the median: e.g. 50,90,99")
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default=None, help="write the results as JSON here")
    bench.add_argument("--save-result", action="store_true",
                       help="vLLM's: write the JSON to --result-dir/--result-filename (default: a dated name here)")
    bench.add_argument("--result-dir", default=None)
    bench.add_argument("--result-filename", default=None)
    bench.add_argument("--plot", default=None, help="draw latency against request rate here (several rates)")


def check_device(text: str | None) -> None:
    """Reject a --device we cannot run on, before any model is loaded."""
    import torch

    if text is None:
        return
    accepted = "cpu, cuda or cuda:N"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {text!r}: use {accepted}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {text!r}: use {accepted}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this PyTorch ({torch.__version__}) was built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
            raise RuntimeError(f"--device {text}: CUDA is not available: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def check_text(what: str, text: str) -> None:
    """Reject text that came from argv as bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = os.fsencode(text[e.start:e.end]) if sys.getfilesystemencodeerrors() == "surrogateescape" else None
        detail = f"bytes {raw!r} at position {e.start}" if raw is not None else f"position {e.start}"
        raise ValueError(f"{what} is not valid UTF-8 ({detail}); pass it as UTF-8 text") from None


def generate(args) -> int:
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    check_text("the prompt", args.prompt)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed if args.seed is not None else random.randrange(2**62),
                                max_tokens=args.max_tokens)
    except ValueError as e:  # a bad --top-k or --top-p: a usage error, like a bad --temperature
        raise UsageError(str(e)) from e
    check_device(args.device)
    llm = LLM(args.model, device=args.device, max_num_seqs=1, max_model_len=args.max_tokens + 4096,
              tensor_parallel_size=args.tensor_parallel_size)
    if args.chat:
        if llm.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; drop --chat")
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        if out.error:  # the request failed; error says why
            raise ValueError(out.error)
        completion = out.outputs[0]
        count = len(completion.token_ids)
        sys.stdout.write(completion.text)
    else:
        start, count = time.perf_counter(), 0
        for _, text, token, _ in llm.stream(args.prompt, params):
            if token is None:  # the request failed; text says why
                raise ValueError(text)
            sys.stdout.write(text)
            sys.stdout.flush()
            count += 1
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{count} tokens in {seconds:.1f} s, {count / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def serve(args) -> int:
    if args.data_parallel_size > 1:  # replicas behind a router (serve/data_parallel.py)
        if args.headless:
            raise UsageError("--data-parallel-size: replicas need no --headless nodes; give one or the other")
        from nanoserve.serve.data_parallel import serve_replicas

        return serve_replicas(args)
    if args.headless:  # another node of a tensor-parallel engine: its ranks only, no server (lesson 07)
        from nanoserve.engine.engine_args import EngineArgs
        from nanoserve.engine.tp_nodes import serve_node

        return serve_node(EngineArgs.from_cli_args(args))
    from nanoserve.engine.engine_args import EngineArgs
    from nanoserve.engine.llm import LLM
    from nanoserve.serve.api_server import serve as serve_http

    check_device(args.device)
    from nanoserve.serve.reasoning import REASONING_PARSERS
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise UsageError(f"--reasoning-parser: {args.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
    names = args.served_model_name
    if names and len(names) > 1:
        raise UsageError(f"--served-model-name: one name only so far, got {len(names)}")
    llm = LLM(engine_args=EngineArgs.from_cli_args(args))  # every engine flag (SERVE_ENGINE_FLAGS)
    if args.chat_template is not None:  # vLLM's --chat-template: a file, or the template's text
        path = os.path.expanduser(args.chat_template)
        llm.tokenizer.chat_template = open(path).read() if os.path.isfile(path) else args.chat_template
    api_key = args.api_key
    if api_key is None and os.environ.get("VLLM_API_KEY"):  # how vLLM's users give the key: never ignored
        api_key = os.environ["VLLM_API_KEY"]
        print("nanoserve: the API key is VLLM_API_KEY's (from the environment)", flush=True)
    serve_http(llm, names[0] if names else args.model, args.host, args.port, args.max_waiting_requests,
               api_key, log_level=args.uvicorn_log_level,
               trust_request_chat_template=args.trust_request_chat_template,
               enable_request_id_headers=args.enable_request_id_headers,
               return_tokens_as_token_ids=args.return_tokens_as_token_ids,
               enable_force_include_usage=args.enable_force_include_usage,
               reasoning_parser=args.reasoning_parser,
               enable_prompt_tokens_details=args.enable_prompt_tokens_details,
               enable_server_load_tracking=args.enable_server_load_tracking,
               enable_per_request_metrics=args.enable_per_request_metrics, root_path=args.root_path)
    return 0


def bench(args) -> int:
    if not args.features:
        if args.rounds is not None or args.max_tokens is not None:
            raise UsageError("--rounds and --max-tokens go with --features")
        from nanoserve.bench import main as bench_main

        return bench_main(args.model, not args.no_baseline, args.out, args.num_seqs, args.profile, args.ladder,
                          args.tensor_parallel_size, args.custom_all_reduce, args.kv_cache_dtype)
    if args.profile or args.ladder:
        raise UsageError("--features times the workload alone: drop --profile and --ladder")
    from nanoserve.bench import bench_features

    return bench_features(args.model, args.out, args.num_seqs, rounds=args.rounds or 2,
                          max_tokens=args.max_tokens or 256, kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tensor_parallel_size, custom_all_reduce=args.custom_all_reduce)


def run(args) -> int:
    import torch

    torch.set_grad_enabled(False)
    if args.command == "generate":
        return generate(args)
    if args.command == "bench":
        return bench(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench-serve":
        from nanoserve.serve.benchmark import main as bench_serve_main

        args.base_url = args.base_url or f"http://{args.host}:{args.port}"
        endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(args.endpoint, args.endpoint)
        args.endpoint = "chat" if args.backend == "openai-chat" else endpoint
        if args.endpoint not in ("completions", "chat"):
            raise UsageError(f"--endpoint: completions or chat (or /v1/completions, /v1/chat/completions), "
                             f"got {endpoint!r}")
        if (args.dataset_name == "custom") != (args.dataset is not None) and not (
                args.dataset_name == "course" and args.dataset is not None):  # (--dataset alone: custom)
            raise UsageError("--dataset-name custom and --dataset-path go together")
        return bench_serve_main(args)
    if args.command == "prepare":
        from nanoserve.model.zoo import resolve_model

        for name in args.models:
            print(f"{name}: {resolve_model(name)}")
        return 0
    return 2


def _fail(args, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    else:
        print(f"nanoserve: {message}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: data parallelism's replicas get them
    try:
        return run(args)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", 130)
    except UsageError as e:
        return _fail(args, str(e), 2)
    except EXPECTED_ERRORS as e:
        if isinstance(e, BrokenPipeError):  # stdout's reader went away (`| head`): no second error at exit
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        return _fail(args, str(e) or type(e).__name__, 1)


if __name__ == "__main__":
    sys.exit(main())

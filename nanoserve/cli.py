"""The `nanoserve` command line.

    nanoserve generate "Once upon a time" [--model NAME_OR_DIR] [--max-tokens N]
                       [--temperature T] [--seed S] [--chat]
    nanoserve prepare tiny-qwen3 smollm2-135m-instruct
    nanoserve bench [--model NAME_OR_DIR] [--num-seqs N] [--no-baseline] [--out FILE]
"""
import argparse
import random
import sys
import time

import torch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A Qwen3 inference engine built in notebooks.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a completion of a prompt")
    gen.add_argument("prompt", help="the text to complete (with --chat: the user's message)")
    gen.add_argument("--model", default=None,
                     help="a model directory, a hub id in the local HF cache, or one of tiny-qwen3, "
                          "qwen3-0.6b-random, smollm2-135m-instruct (default: a cached Qwen3, else SmolLM2)")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="0 = greedy (default); higher = more random")
    gen.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample only from the smallest set of tokens "
                                                               "whose probability reaches p (default 1 = all)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling, for reproducible output")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    bench = sub.add_parser("bench", help="the course's benchmark workload (GPU), against transformers")
    bench.add_argument("--model", default="qwen3-0.6b-random")
    bench.add_argument("--num-seqs", type=_positive_int, default=256)
    bench.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--out", default=None, help="also write the results as JSON here")
    prep = sub.add_parser("prepare", help="build or find models now, so later runs start at once")
    prep.add_argument("models", nargs="+", help="model names, hub ids or directories")
    return parser


def generate(args) -> int:
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed if args.seed is not None else random.randrange(2**62),
                                max_tokens=args.max_tokens)
    except ValueError as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, device=args.device, max_num_seqs=1, max_model_len=args.max_tokens + 4096)
    if args.chat and llm.tokenizer.chat_template is None:
        print("nanoserve: this model has no chat template; drop --chat", file=sys.stderr)
        return 2
    # --chat: a list of messages, which LLM renders with the model's chat template
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    start, count = time.perf_counter(), 0
    for _, text, token, _ in llm.stream(prompt, params):
        if token is None:  # the request failed; text says why
            print(f"nanoserve: {text}", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        sys.stdout.flush()
        count += 1
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{count} tokens in {seconds:.1f} s, {count / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "bench":
            from nanoserve.bench import main as bench_main

            return bench_main(args.model, not args.no_baseline, args.out, args.num_seqs)
        if args.command == "prepare":
            from nanoserve.zoo import resolve_model

            for name in args.models:
                print(f"{name}: {resolve_model(name)}")
            return 0
    except (FileNotFoundError, ValueError) as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

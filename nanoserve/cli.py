"""The `nanoserve` command line.

    nanoserve generate "Once upon a time" [--model NAME_OR_DIR] [--max-tokens N]
                       [--temperature T] [--seed S] [--chat]
    nanoserve prepare tiny-qwen3 smollm2-135m-instruct
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
    prep = sub.add_parser("prepare", help="build or find models now, so later runs start at once")
    prep.add_argument("models", nargs="+", help="model names, hub ids or directories")
    return parser


def generate(args) -> int:
    from transformers import AutoTokenizer

    from nanoserve.detokenizer import Detokenizer
    from nanoserve.generate import generate as generate_tokens
    from nanoserve.loader import eos_token_ids, load_model
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.zoo import resolve_model

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path, device=args.device)
    if args.chat:
        if tokenizer.chat_template is None:
            print(f"nanoserve: {path} has no chat template; drop --chat", file=sys.stderr)
            return 2
        # enable_thinking=False: Qwen3 answers at once instead of reasoning first (other templates ignore it)
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
            enable_thinking=False)
        if hasattr(prompt_ids, "keys"):  # newer transformers return a BatchEncoding
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        print("nanoserve: the prompt is empty", file=sys.stderr)
        return 2

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_tokens=args.max_tokens)
    except ValueError as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    stream = Detokenizer(tokenizer)

    def on_token(index: int, token: int) -> None:
        sys.stdout.write(stream.add(token))
        sys.stdout.flush()

    start = time.perf_counter()
    # Without --seed, a fresh random draw each run (the loop's own seed is fixed for reproducibility).
    completions, _ = generate_tokens(model, [prompt_ids], params, eos_token_ids=eos_token_ids(path, tokenizer),
                                     seed=random.randrange(2**62), on_token=on_token)
    sys.stdout.write(stream.flush())
    new_ids = completions[0].token_ids
    seconds = time.perf_counter() - start
    print()
    print(f"[{path.name}: {len(prompt_ids)} prompt + {len(new_ids)} generated tokens in {seconds:.1f} s, "
          f"{len(new_ids) / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        if args.command == "generate":
            return generate(args)
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

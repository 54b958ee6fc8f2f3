"""vLLM's `vllm.utils.argparse_utils`: the parser its example scripts build, with EngineArgs.add_cli_args."""
import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also takes a long flag written with underscores (--max_model_len), as vLLM's does."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([dashed(a) for a in args], namespace)


def dashed(arg: str) -> str:
    """--max_model_len=8 -> --max-model-len=8; values and short flags stay as they are."""
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return flag.replace("_", "-") + equals + value

"""vLLM's `vllm.engine.arg_utils`: EngineArgs, an engine's settings (nanoserve/engine/engine_args.py defines it,
with vLLM's add_cli_args and from_cli_args)."""
from nanoserve.engine.engine_args import EngineArgs

__all__ = ["EngineArgs"]

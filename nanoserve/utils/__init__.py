"""vLLM's `vllm.utils` paths that scripts import from (argparse_utils)."""

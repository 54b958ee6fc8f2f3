"""vLLM's `vllm.distributed`: cleanup_dist_env_and_memory, which scripts call between two LLMs in one process."""
import gc

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Give back what a dropped LLM held: its process group (torch.distributed's, if one was made in this
    process) and its memory (Python's garbage, then CUDA's cached blocks). An LLM that is still referenced
    keeps its memory: `del llm` first, or `llm.shutdown()`, which frees its model and KV pool (and its
    tensor-parallel workers) whoever still holds it. shutdown_ray: nanoserve uses no Ray; only False."""
    if shutdown_ray:
        raise ValueError("cleanup_dist_env_and_memory: shutdown_ray=True: nanoserve does not use Ray")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

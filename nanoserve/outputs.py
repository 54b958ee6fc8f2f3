"""vLLM's `vllm.outputs`: what LLM.generate and LLM.chat return (nanoserve/engine/llm.py defines them)."""
from nanoserve.engine.llm import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]

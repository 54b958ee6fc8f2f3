"""vLLM's `vllm.sampling_params`: a request's parameters (nanoserve/engine/sampling_params.py defines them)."""
from nanoserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

"""vLLM's `vllm.sampling_params`: a request's parameters (nanoserve/engine/sampling_params.py defines them), and
beam search's (nanoserve/features/beam_search.py)."""
from nanoserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.features.beam_search import BeamSearchParams

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutputsParams"]

"""vLLM's `vllm.beam_search`: what LLM.beam_search returns (nanoserve/features/beam_search.py defines it)."""
from nanoserve.features.beam_search import BeamSearchOutput, BeamSearchSequence

__all__ = ["BeamSearchOutput", "BeamSearchSequence"]

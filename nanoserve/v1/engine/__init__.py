"""vLLM's `vllm.v1.engine`: LLMEngine, the request-level engine that `from vllm import LLMEngine` gives."""

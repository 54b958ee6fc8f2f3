"""vLLM's `vllm.v1.sample` paths that scripts import from: `logits_processor` (vLLM's batch-level logits
processor interface, run by nanoserve's engine through an adapter)."""

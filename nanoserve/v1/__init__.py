"""vLLM's `vllm.v1` paths that scripts import from: `v1.metrics.reader` (LLM.get_metrics's metric objects)."""

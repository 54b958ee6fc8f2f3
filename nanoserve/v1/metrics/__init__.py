"""vLLM's `vllm.v1.metrics`: the metrics LLM(disable_log_stats=False) keeps (stats.py) and their reader."""

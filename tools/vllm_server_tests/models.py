"""Which of nanoserve's zoo models stands in for a model a vLLM test names.

Nothing here downloads: vLLM's tests name hub checkpoints (Qwen3-0.6B, Qwen2.5-1.5B-Instruct, zephyr-7b, ...),
and a CPU without a network runs two small zoo models instead. Qwen checkpoints get tiny-qwen3 (random weights,
but Qwen's real tokenizer and chat template, with thinking and tools); every other one gets smollm2-135m-instruct
(trained weights, Llama's architecture). A test whose assertion depends on what the real model says fails here
for that reason alone: run.py counts those apart (CAUSES, kind "stand-in model").
"""

from pathlib import Path


def stand_in(model: str) -> tuple[Path, str]:
    """(the model directory to serve, the zoo name or "path") for a model name or path from a vLLM test."""
    from nanoserve.model.zoo import resolve_model

    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return path, "path"
    zoo = "tiny-qwen3" if model.lower().startswith("qwen/") else "smollm2-135m-instruct"
    return resolve_model(zoo), zoo

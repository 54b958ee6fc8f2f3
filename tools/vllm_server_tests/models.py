"""Which of nanoserve's zoo models stands in for a model a vLLM test names.

Nothing here downloads: vLLM's tests name hub checkpoints (Qwen3-0.6B, Qwen2.5-1.5B-Instruct, zephyr-7b, ...),
and a CPU without a network runs two small zoo models instead. Qwen checkpoints get tiny-qwen3 (random weights,
but Qwen's real tokenizer and chat template, with thinking and tools); every other one gets smollm2-135m-instruct
(trained weights, Llama's architecture). A test whose assertion depends on what the real model says fails here
for that reason alone: run.py counts those apart (CAUSES, kind "stand-in model").

Each is served from a copy of its checkpoint (standin_checkpoint) with settings of the checkpoints it stands for:
- generation_config.json's max_new_tokens (MAX_NEW_TOKENS). A real model ends its answer with its end-of-turn
  token; random weights almost never draw it, and SmolLM2-135M, given a role or a format it was not trained on,
  sometimes rambles on. A request without max_tokens would then run to max_model_len, minutes on a CPU, and the
  test would time out on the stand-in, not on anything the server does. max_new_tokens is a default vLLM itself
  honours (it becomes the max_tokens of requests that give none); a request's own max_tokens still wins.
- tiny-qwen3's config.json's max_position_embeddings (QWEN_CONTEXT): the context of the Qwen checkpoints the
  tests name (32768 and more) rather than tiny-qwen3's 4096, so that a --max-model-len above 4096 means what it
  says.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

# SmolLM2 makes about 10 tokens a second on a loaded 2-core CPU: a test of two such answers stays within 30 s
MAX_NEW_TOKENS = {"tiny-qwen3": 64, "smollm2-135m-instruct": 64}
QWEN_CONTEXT = 32768  # Qwen2-1.5B's, Qwen2.5-1.5B's; Qwen3-0.6B's is 40960


def stand_in(model: str) -> tuple[Path, str]:
    """(the model directory to serve, the zoo name or "path") for a model name or path from a vLLM test."""
    from nanoserve.model.zoo import resolve_model

    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return path, "path"
    zoo = "tiny-qwen3" if model.lower().startswith("qwen/") else "smollm2-135m-instruct"
    return standin_checkpoint(resolve_model(zoo), zoo), zoo


def standin_checkpoint(source: Path, zoo: str) -> Path:
    """A checkpoint folder beside the scratch tree's logs (VST_LOG_DIR): source's files (hard links, or copies:
    nanoserve refuses a symlink that leaves the model's folder), with MAX_NEW_TOKENS in its
    generation_config.json, and for tiny-qwen3 QWEN_CONTEXT in its config.json. Made once; pytest's workers may
    race to make it."""
    logs = os.environ.get("VST_LOG_DIR")
    root = Path(logs).parent if logs else Path(tempfile.gettempdir())
    target = root / f"{source.name}-stand-in"
    if (target / "generation_config.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
    for f in source.iterdir():
        if f.name not in ("generation_config.json", "config.json"):
            try:
                os.link(f, staging / f.name)
            except OSError:  # another file system
                shutil.copy(f, staging / f.name)
    settings = {"generation_config.json": {"max_new_tokens": MAX_NEW_TOKENS[zoo]},
                "config.json": {"max_position_embeddings": QWEN_CONTEXT} if zoo == "tiny-qwen3" else {}}
    for name, setting in settings.items():
        config = json.loads((source / name).read_text()) if (source / name).is_file() else {}
        (staging / name).write_text(json.dumps({**config, **setting}, indent=1))
    try:
        staging.rename(target)
    except OSError:  # another worker made it first
        shutil.rmtree(staging, ignore_errors=True)
    return target

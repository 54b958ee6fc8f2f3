"""A stand-in `vllm` package, for the names vLLM's server test files import at module level.

The `vllm` package is not installed here, and the server under test is nanoserve's, so what those files take
from vllm is either a helper the test needs to compute what it expects, or one of vLLM's own classes that only
its unit tests use. The first kind is implemented here (REAL); every other name becomes a placeholder class
that accepts any construction and any attribute, so that modules importing it load, and a unit test that uses
one fails (run.py counts a test that never reached a server as not applicable). Each placeholder handed out is
recorded in AUTO_STUBBED, which run.py saves with the results.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types

AUTO_STUBBED: set[str] = set()


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__module__}.{cls.__qualname__}.{name}")


class Placeholder(metaclass=_PlaceholderMeta):
    """One of vLLM's classes or functions that the server tests import but do not need."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return type(self)()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(self)()


def _placeholder(qualname: str) -> type:
    AUTO_STUBBED.add(qualname)
    module, _, name = qualname.rpartition(".")
    return _PlaceholderMeta(name, (Placeholder,), {"__module__": module})


# --- names whose behaviour the tests rely on -------------------------------------------------------------------


class _Platform:
    """vllm.platforms.current_platform: a CPU without CUDA, ROCm, XPU or FP8."""

    def __getattr__(self, name):
        if name.startswith(("is_", "supports_", "has_")):
            return lambda *a, **k: name == "is_cpu"
        raise AttributeError(name)

    def device_count(self) -> int:
        return 0


def get_tokenizer(tokenizer_name=None, *args, **kwargs):
    """The stand-in model's tokenizer for the model a test names (the test compares token ids with it)."""
    from transformers import AutoTokenizer

    from models import stand_in

    name = tokenizer_name if tokenizer_name is not None else kwargs.get("tokenizer")
    return AutoTokenizer.from_pretrained(stand_in(str(name))[0])


class ModelConfig:
    """vllm.config.ModelConfig, as far as the tests use it: the vocabulary size of the (stand-in) model."""

    def __init__(self, model=None, *args, **kwargs):
        from models import stand_in

        self.model = model
        self._dir = stand_in(str(model))[0]

    def get_vocab_size(self) -> int:
        return json.loads((self._dir / "config.json").read_text())["vocab_size"]


class VLLMValidationError(ValueError):
    pass


def get_open_port() -> int:
    from standin_server import get_open_port as free_port

    return free_port()


def download_weights_from_hf(model_name_or_path, *args, **kwargs):
    from models import stand_in

    return str(stand_in(model_name_or_path)[0])


class _HfApi:
    """LoRA adapters and other downloads: an empty folder (the flags that would load them are dropped)."""

    def snapshot_download(self, *args, **kwargs):
        return tempfile.mkdtemp(prefix="vst-download-")


def _envs_getattr(name):
    value = os.environ.get(name)
    if value is None:
        return False if name.startswith(("VLLM_USE_", "VLLM_ENABLE_")) else None
    return value


def _version() -> str:
    return os.environ.get("VST_VLLM_VERSION", "0.0.0")


def _prev_minor_version() -> str:
    major, minor = _version().split(".")[:2]
    return f"{major}.{int(minor) - 1}"


REAL = {
    "vllm": {"__version__": _version},
    "vllm.platforms": {"current_platform": _Platform},
    "vllm.tokenizers": {"get_tokenizer": lambda: get_tokenizer},
    "vllm.config": {"ModelConfig": lambda: ModelConfig},
    "vllm.exceptions": {"VLLMValidationError": lambda: VLLMValidationError},
    "vllm.utils.network_utils": {"get_open_port": lambda: get_open_port},
    "vllm.model_executor.model_loader.weight_utils": {"download_weights_from_hf": lambda: download_weights_from_hf},
    "vllm.transformers_utils.repo_utils": {"hf_api": lambda: _HfApi},
    "vllm.version": {"__version__": _version, "_prev_minor_version": lambda: _prev_minor_version},
}


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        for name, make in REAL.get(spec.name, {}).items():
            setattr(module, name, make())
        if spec.name == "vllm.envs":
            module.__getattr__ = _envs_getattr
        else:
            module.__getattr__ = lambda name, _m=spec.name: _module_getattr(_m, name)
        return module

    def exec_module(self, module):
        pass


def _module_getattr(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if f"{module}.{name}" in REAL or f"{module}.{name}" == "vllm.envs":  # `from vllm import envs, version`
        return importlib.import_module(f"{module}.{name}")
    return _placeholder(f"{module}.{name}")


def _hub_tokenizers_stand_in() -> None:
    """transformers' AutoTokenizer.from_pretrained("TinyLlama/...") in a test (its expected token counts) loads
    the stand-in's tokenizer, as get_tokenizer does: the one the server counts with. (Without a network, the hub
    id would fail anyway, after about 50 s of retries: past the per-test timeout.)"""
    from transformers import AutoTokenizer

    from models import stand_in

    original = AutoTokenizer.from_pretrained.__func__
    if getattr(original, "stand_in", False):
        return

    def from_pretrained(cls, name, *args, **kwargs):
        if isinstance(name, str) and not os.path.isdir(name):
            name = str(stand_in(name)[0])
        return original(cls, name, *args, **kwargs)

    from_pretrained.stand_in = True
    AutoTokenizer.from_pretrained = classmethod(from_pretrained)


def install() -> None:
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    _hub_tokenizers_stand_in()

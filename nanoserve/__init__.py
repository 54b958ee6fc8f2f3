"""nanoserve: a Qwen3 inference engine you build yourself, one notebook at a time.

Most modules here are generated from the notebooks in solutions/ (they say so in their first line);
edit the notebook and run `make export`, never the generated file.
"""

__version__ = "0.1.0"


PUBLIC = {"LLM": "nanoserve.engine.llm", "EngineArgs": "nanoserve.engine.engine_args",
          "EngineParts": "nanoserve.engine.engine_args",
          "SamplingParams": "nanoserve.engine.sampling_params",
          "StructuredOutputsParams": "nanoserve.engine.sampling_params"}


def __getattr__(name):
    """`from nanoserve import LLM, SamplingParams, EngineArgs` without importing the engine until it is used."""
    if name in PUBLIC:
        import importlib

        return getattr(importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

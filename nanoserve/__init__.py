"""nanoserve: a Qwen3 inference engine you build yourself, one notebook at a time.

Most modules here are generated from the notebooks in solutions/ (they say so in their first line);
edit the notebook and run `make export`, never the generated file.
"""

__version__ = "0.1.0"


PUBLIC = {"LLM": "nanoserve.engine.llm", "EngineArgs": "nanoserve.engine.engine_args",
          "EngineParts": "nanoserve.engine.engine_args",
          "SamplingParams": "nanoserve.engine.sampling_params",
          "StructuredOutputsParams": "nanoserve.engine.sampling_params",
          # vLLM's request-level engine, over LLM (lesson 05's token-level LLMEngine is
          # nanoserve.engine.llm_engine's)
          "LLMEngine": "nanoserve.v1.engine.llm_engine", "RequestOutput": "nanoserve.engine.llm",
          "CompletionOutput": "nanoserve.engine.llm"}


def __getattr__(name):
    """`from nanoserve import LLM, SamplingParams, EngineArgs` (vLLM's names) without importing the
    engine until it is used."""
    if name in PUBLIC:
        import importlib

        return getattr(importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""nanoserve: a Qwen3 inference engine you build yourself, one notebook at a time.

Most modules here are generated from the notebooks in solutions/ (they say so in their first line);
edit the notebook and run `make export`, never the generated file.
"""

__version__ = "0.1.0"


def __getattr__(name):
    """`from nanoserve import LLM, SamplingParams` without importing the engine until it is used."""
    if name == "LLM":
        from nanoserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanoserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

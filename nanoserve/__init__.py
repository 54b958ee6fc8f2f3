"""nanoserve: a Qwen3 inference engine you build yourself, one notebook at a time.

Most modules here are generated from the notebooks in solutions/ (they say so in their first line);
edit the notebook and run `make export`, never the generated file.
"""

__version__ = "0.1.0"

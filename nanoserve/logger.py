"""vLLM's `vllm.logger.init_logger`, for scripts written against vLLM: a standard library logger under the
"nanoserve" logger (which the command line's own messages use too)."""
import logging


def init_logger(name: str) -> logging.Logger:
    """The logger for `name` (a module's __name__), printing INFO and above to stderr unless configured."""
    root = logging.getLogger("nanoserve")
    if not root.handlers and not logging.getLogger().handlers:  # nothing configured: vLLM's default level
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return logging.getLogger(name if name.startswith("nanoserve") else f"nanoserve.{name}")

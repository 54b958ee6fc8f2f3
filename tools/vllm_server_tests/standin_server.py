"""The stand-in for vLLM's tests/utils.py: `RemoteOpenAIServer` starts `nanoserve serve` instead of `vllm serve`.

run.py copies this file to tests/utils.py of the scratch tree, so that `from tests.utils import
RemoteOpenAIServer` in vLLM's test files gets this class. It keeps the interface those files use (url_for,
get_client, get_async_client, host, port, the context manager) and changes three things:
- the model: a hub id the tests name becomes one of nanoserve's zoo models (models.stand_in), served under the
  name the test uses, so requests that say `model=MODEL_NAME` still match;
- the flags: vLLM's flags that `nanoserve serve` takes pass through, the rest are dropped and recorded, so
  each test's result says which of its server's flags were missing;
- readiness: it polls GET /health, as vLLM's does, and fails when the process exits first.
"""

import argparse
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest
import requests

from models import stand_in

NANOSERVE = os.environ.get("VST_NANOSERVE", "nanoserve")
VLLM_PATH = Path(os.environ.get("VST_VLLM_DIR", "."))
ROCM_EXTRA_ARGS: list[str] = []
requires_fp8 = pytest.mark.skip(reason="needs an FP8 GPU")

# The servers a test used (set by the plugin at each test's start), for its record.
TOUCHED: list["RemoteOpenAIServer"] = []


def multi_gpu_only(*, num_gpus: int = 2):
    return pytest.mark.skip(reason=f"needs {num_gpus} GPUs")


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_flags() -> dict[str, argparse.Action]:
    """`nanoserve serve`'s flags, read from its own parser, so new ones are picked up as they land."""
    from nanoserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: action for action in sub.choices["serve"]._actions for opt in action.option_strings}


_FLAGS: dict[str, argparse.Action] | None = None


def _refused(action: argparse.Action) -> bool:
    # nanoserve.cli marks the vLLM flags it knows but will not take with an action that errors when used.
    return hasattr(action, "why")


def map_args(args: list[str]) -> tuple[list[str], list[str], str | None]:
    """vLLM's serve args -> (the ones nanoserve takes, the dropped ones, a --model override if any)."""
    global _FLAGS
    if _FLAGS is None:
        _FLAGS = _serve_flags()
    kept, dropped, model = [], [], None
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-"):
            dropped.append(token)  # a stray value: nothing to attach it to
            continue
        flag, eq, inline = token.partition("=")
        values = [inline] if eq else []
        action = _FLAGS.get(flag)
        if not eq:
            # How many values follow: nanoserve's parser says for its flags; for the others, every token up to the
            # next flag (vLLM's flags that take values never take one starting with "--").
            want = 0 if action is not None and action.nargs == 0 else None
            while i < len(args) and want != 0 and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
                if action is not None and action.nargs in (None, 1, "?"):
                    break
        if flag == "--model":
            model = values[0]
        elif action is not None and not _refused(action):
            kept += [flag, *values]
        else:
            dropped.append(" ".join([flag, *values]))
    return kept, dropped, model


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:
        args = list(vllm_serve_args)
        if auto_port:
            if "--port" in args or "-p" in args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            args += ["--port", str(get_open_port())]
        if seed is not None:
            args += ["--seed", str(seed)]
        kept, self.dropped, override = map_args(args)
        if "--dtype" in kept:
            # Half precision is those tests' GPU speed setting; on a CPU it is several times slower than float32,
            # and no assertion depends on it.
            i = kept.index("--dtype")
            self.cpu_substitutes = [f"--dtype {kept[i + 1]} -> float32"]
            del kept[i:i + 2]
        else:
            self.cpu_substitutes = []
        if override_hf_configs is not None:
            self.dropped.append("--hf-overrides")
        self.model = override or model
        self.model_dir, self.stand_in = stand_in(self.model)
        if "--served-model-name" not in kept:
            kept += ["--served-model-name", self.model]
        if "--host" not in kept:
            kept += ["--host", "127.0.0.1"]
        self.host = kept[kept.index("--host") + 1]
        self.port = int(kept[kept.index("--port") + 1])
        self.uds = None
        self.show_hidden_metrics = False
        self.command = [NANOSERVE, "serve", str(self.model_dir), "--device", "cpu", *kept]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("VST_SERVER_THREADS", "1"), **(env_dict or {})}
        log = open(os.environ.get("VST_LOG_DIR", ".") + f"/server-{self.port}.log", "w")
        log.write(" ".join(self.command) + "\n" + f"dropped: {self.dropped}\n")
        log.flush()
        self.proc = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.log_path = log.name
        log.close()
        TOUCHED.append(self)
        atexit.register(self._shutdown)
        try:
            self._wait_for_server(max_wait_seconds or 120)
        except BaseException:
            self._shutdown()
            raise

    def _wait_for_server(self, timeout: float) -> None:
        start = time.time()
        while True:
            try:
                if requests.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                tail = Path(self.log_path).read_text().strip().splitlines()[-1:]
                raise RuntimeError(f"Server exited unexpectedly: {tail[0] if tail else ''}")
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def _touch(self):
        if not TOUCHED or TOUCHED[-1] is not self:
            TOUCHED.append(self)

    @property
    def url_root(self) -> str:
        self._touch()
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def record(self) -> dict:
        return {"model": self.model, "stand_in": self.stand_in, "dropped_flags": self.dropped,
                "cpu_substitutes": self.cpu_substitutes}


RemoteVLLMServer = RemoteOpenAIServer


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    """vLLM's server run in-process with a patched engine: nothing here to patch."""

    def __init__(self, *args, **kwargs):
        pytest.skip("not applicable: runs vLLM's server in-process with its own hooks")

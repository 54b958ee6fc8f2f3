"""Features beside the core: a plain request's step runs no feature code, and no core module imports
a feature module (the engine finds a feature through engine/features.py's table, when a request asks)."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import size  # noqa: E402  (tools/size.py: the trace of a plain request)

CORE = ("engine", "cache", "model", "kernels")


@pytest.fixture(scope="module")
def plain():
    return size.trace_plain_request()


def test_a_plain_step_runs_no_feature_code(plain):
    ran = {qualname for _, qualname in plain["ran"]}
    assert not [f for f, _ in plain["ran"] if "/features/" in f]
    assert not [f for f in plain["imported"] if "/features/" in f]
    assert not ran & {"BatchProcessors.apply", "BatchProcessors.drawn", "LogprobsList.append"}
    assert {"ModelRunner.launch", "ModelRunner.draw", "Sampler.__call__"} <= ran  # the trace saw the step


def test_no_core_line_is_over_100_characters(plain):
    """The core as tools/size.py counts it (what a plain request imports, and the GPU's path) fits in 100
    characters a line: a learner reads it on a laptop without scrolling sideways."""
    over = [f"{path.relative_to(size.ROOT)}:{n}" for path in size.core_files(plain)
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert len(size.core_files(plain)) > 20 and not over, over[:10]


def test_a_request_that_asks_runs_its_feature():
    """The control: the same trace finds a feature's code when a request asks for it."""
    asked = size.trace_plain_request(presence_penalty=0.5, logprobs=2)
    ran = {qualname for _, qualname in asked["ran"]}
    assert {"Penalties.apply", "Penalties.drawn", "SampledLogprobs.__init__", "BatchProcessors.apply"} <= ran


@pytest.mark.parametrize("path", sorted(p for part in CORE for p in (ROOT / "nanoserve" / part).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "nanoserve")))
def test_no_core_module_imports_a_feature_module(path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not [n for n in names if n.startswith("nanoserve.features")], f"{path}:{node.lineno}"

"""The scratch tree's tests/conftest.py (run.py copies it there): stubs, not-applicable marks, one record a test.

vLLM's own tests/conftest.py brings vLLM's whole runtime (LLM, model runners, multimodal assets): it is
replaced by this file, which keeps only what the selected files import from it.
"""

import json
import os
import re

import pytest

import vllm_stubs

vllm_stubs.install()

from tests import utils as standin  # noqa: E402  (after the stubs: tests.utils imports nothing of vllm)

# Features nanoserve does not have by design, matched against the test id (parameters included).
NOT_APPLICABLE = [
    (r"lora", "LoRA adapters"),
    (r"prompt_embed|_embeds\b|embeds\[", "prompt embeddings"),
    (r"image|audio|video|vision|multimodal|\bmm_", "multimodal input"),
    (r"harmony", "Responses-API harmony parsers"),
    (r"sleep", "sleep mode"),
    (r"pooling|embedding", "pooling / embeddings"),
    (r"test_v2_endpoint", "pooling / embeddings (Cohere's /v2/embed)"),
]


class LocalAssetServer:
    """tests.conftest's server of images and videos: only multimodal tests use it."""


@pytest.fixture(scope="session")
def local_asset_server():
    pytest.skip("not applicable: multimodal assets")


def pytest_collection_modifyitems(items):
    for item in items:
        for pattern, why in NOT_APPLICABLE:
            if re.search(pattern, item.nodeid, re.IGNORECASE):
                item.add_marker(pytest.mark.skip(reason=f"not applicable: {why}"))
                break


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    standin.TOUCHED.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    item.user_properties[:] = [("servers", [s.record() for s in standin.TOUCHED])]
    yield


def pytest_runtest_logreport(report):
    path = os.environ.get("VST_RESULTS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # with xdist, the controller writes what its workers report
    line = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        line = report.longrepr[2]
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        line = crash.message if crash is not None else str(report.longrepr)
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "message": line.strip().splitlines()[0][:400] if line.strip() else "",
              "duration": round(report.duration, 2), **dict(report.user_properties)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session):
    path = os.environ.get("VST_RESULTS")
    if path:
        with open(f"{path}.stubs.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "w") as f:
            json.dump(sorted(vllm_stubs.AUTO_STUBBED), f)

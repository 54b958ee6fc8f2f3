import os

import pytest

# Tests never reach the network: the HF hub is only ever read from the local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The slow part of the suite (`pytest -m "not slow"` runs the rest in a few minutes): every solution notebook
# run top to bottom by nbval, and the modules that start fresh processes (make check, make mine, TP ranks).
SLOW_MODULES = {"test_make_check.py", "test_lessons_run_your_code.py", "test_build_mine.py",
                "test_tensor_parallel.py", "test_overlap.py", "test_router.py"}


# The longest files, longest first (seconds of a CI run on 2 cores): `make test` hands whole files to two
# workers in collection order, so a long file collected last would run alone at the end.
LONGEST_FIRST = ["test_make_check.py", "test_lessons_run_your_code.py", "test_triton_attention.py",
                 "test_feature_fairness.py", "test_tensor_parallel.py", "test_exercises.py", "test_request_safety.py",
                 "test_overlap.py", "test_hardening.py", "06_cuda_graphs.ipynb", "08_serving.ipynb"]


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb" or item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept

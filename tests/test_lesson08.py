"""Lesson 08: the exercise checks pass on the engine's serving code, and each untouched stub fails its own check
(the server itself is tested end to end in test_serve.py)."""
import functools

import pytest
from lesson_source import generated_lesson

from nanoserve.checks import lesson08 as checks
from nanoserve.serve import async_engine, protocol


def exercises(ns):
    """Name -> the check run on ns's implementation (the table: checks.EXERCISES, shared with `make check`)."""
    return {name: functools.partial(check, ns) for name, check in checks.EXERCISES.items()}


ENGINE = {**vars(async_engine), **vars(protocol)}


@pytest.mark.parametrize("name", list(exercises(ENGINE)))
def test_engine_passes_check(name):
    exercises(ENGINE)[name]()


@pytest.mark.parametrize("name", list(exercises(ENGINE)))
def test_untouched_stub_fails_its_check(name):
    ns = {"__name__": "lesson08"}
    for cell in generated_lesson("08_serving")["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith("#| export"):
            exec(compile(source, "lesson08", "exec"), ns)
    number = name.split()[0]
    if number == "8.2":  # isolate the _forget stub: 8.1 solved (its stub would end the step loop first)
        ns["AsyncEngine"]._deliver = async_engine.AsyncEngine._deliver
    with pytest.raises(NotImplementedError, match=f"Exercise {number}"):
        exercises(ns)[name]()

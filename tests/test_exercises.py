"""Every exercise of every lesson: its check (checks/lessonNN.py's EXERCISES, which `make check` runs on the
learner's notebook) passes on the engine's code, and fails on the lesson's untouched stub."""
import functools
import importlib

import nbformat
import pytest
from lesson_source import ROOT, export, generated_lesson

NOTEBOOKS = {p.stem[:2]: p.stem for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))}
# Checked elsewhere: the Triton kernel needs the interpreter set before triton loads (test_triton_attention.py
# and test_lesson03.py's own stub test).
ELSEWHERE = {"3.4"}


def checks_of(lesson: str) -> dict:
    return importlib.import_module(f"nanoserve.checks.lesson{lesson}").EXERCISES


@functools.cache
def engine_namespace(lesson: str) -> dict:
    """The names of every package module the lesson's notebook exports (the engine's own code)."""
    nb = nbformat.read(ROOT / "solutions" / f"{NOTEBOOKS[lesson]}.ipynb", as_version=4)
    ns = {}
    for module in export._exports(nb, f"{NOTEBOOKS[lesson]}.ipynb"):
        ns.update(vars(importlib.import_module(f"nanoserve.{module}")))
    return ns


def stub_namespace(lesson: str) -> dict:
    """The learner's untouched notebook: its export cells run in order. A later cell that imports the engine's
    version of a name the lesson defined (to go on from a finished exercise) does not replace the lesson's."""
    ns = {"__name__": f"lesson{lesson}"}
    for cell in generated_lesson(NOTEBOOKS[lesson])["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or not source.startswith("#| export") or "@triton.jit" in source:
            continue  # (Triton compiles only functions defined in files: lesson 03's kernel is checked elsewhere)
        own = {k: v for k, v in ns.items() if getattr(v, "__module__", None) == ns["__name__"]}
        exec(compile(source, ns["__name__"], "exec"), ns)
        ns.update({k: v for k, v in own.items() if getattr(ns[k], "__module__", None) != ns["__name__"]})
    return ns


def hybrid(ns: dict, name: str, engine_cls: type, method: str) -> None:
    """ns[name]: the engine's class with only `method` from the lesson (its stub)."""
    ns[name] = type("Hybrid", (engine_cls,), {method: getattr(ns[name], method)})


# Where one exercise's stub would stop the check before it reaches another's: that other is solved here. (The
# checks of 4.2/4.3, 5.1/5.2 and 8.1/8.2 take the other exercise of the pair from the package themselves.)
ISOLATE = {
    "3.2": lambda ns, eng: hybrid(ns, "BlockManager", eng["BlockManager"], "slot"),
    "6.4": lambda ns, eng: ns.update(graph_sizes=eng["graph_sizes"], padded_size=eng["padded_size"]),
    "7.3": lambda ns, eng: [setattr(ns[c], "forward", eng[c].forward) for c in ("RowParallelLinear", "VocabParallelEmbedding")],
}
CASES = [(lesson, name) for lesson in NOTEBOOKS for name in checks_of(lesson) if name.split()[0] not in ELSEWHERE]


@pytest.mark.parametrize("lesson, name", CASES, ids=[name for _, name in CASES])
def test_the_engine_passes_the_check(lesson, name):
    checks_of(lesson)[name](engine_namespace(lesson))


@pytest.mark.parametrize("lesson, name", CASES, ids=[name for _, name in CASES])
def test_the_untouched_stub_fails_the_check(lesson, name):
    number = name.split()[0]
    ns = stub_namespace(lesson)
    if number in ISOLATE:
        ISOLATE[number](ns, engine_namespace(lesson))
    with pytest.raises(NotImplementedError, match=f"Exercise {number}"):
        checks_of(lesson)[name](ns)

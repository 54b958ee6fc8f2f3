"""`make mine` (tools/build_mine.py): the learner's own engine, built from lessons/ next to the reference."""
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_mine  # noqa: E402
import export as ex  # noqa: E402

# Greedy tokens of a couple of prompts; run in a fresh process whose nanoserve comes from PYTHONPATH alone.
GREEDY = """
import json, sys, nanoserve
from nanoserve import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
tokens = {}
for fused in json.loads(sys.argv[1]):  # lesson 06's fused model, lesson 01's plain one
    with LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=64, fused_ops=fused) as llm:
        outputs = llm.generate(["The capital of France is", "Once upon a time", "Hello there"], params,
                               use_tqdm=False)
    tokens[f"fused_ops={fused}"] = [o.outputs[0].token_ids for o in outputs]
print(json.dumps({"file": nanoserve.__file__, "tokens": tokens}))
"""


def greedy(path: Path, tmp: Path, fused=(True, False)) -> dict:
    """The greedy tokens of the nanoserve found at path (checked to be the one imported), per fused_ops."""
    env = dict(os.environ, PYTHONPATH=str(path), PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", GREEDY, json.dumps(list(fused))], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve() == (path / "nanoserve" / "__init__.py").resolve()
    return result["tokens"]


@functools.cache
def generated() -> dict:
    """What the exporter generates now (once for the module's tests)."""
    return ex.generate(ROOT)


@functools.cache
def solution_modules() -> dict[str, tuple[str, bool]]:
    """{module: (notebook, has exercises)}: a module has exercises when its code in the stubbed lesson raises."""
    found = {}
    for rel, text in generated().items():
        if rel.parts[0] == "lessons":
            for name, chunks in ex._exports(nbformat.reads(text, as_version=4), rel.name).items():
                found[name] = (rel.name, any('raise NotImplementedError("Exercise' in c for c in chunks))
    return found


@pytest.fixture(scope="module")
def lessons(tmp_path_factory):
    """Three lessons folders: pristine (what export writes), solved (solutions/), partial (solved but 03)."""
    base = tmp_path_factory.mktemp("lessons")
    pristine, solved, partial = base / "pristine", base / "solved", base / "partial"
    for rel, text in generated().items():  # not lessons/: a learner running the tests may have edited it
        if rel.parts[0] == "lessons":
            ex._write(pristine / rel.name, text)
    for folder in (solved, partial):
        folder.mkdir()
        for path in (ROOT / "solutions").glob("*.ipynb"):
            shutil.copy(path, folder / path.name)
    shutil.copy(next(pristine.glob("03_*.ipynb")), partial)
    return dict(pristine=pristine, solved=solved, partial=partial)


@pytest.fixture(scope="module")
def builds(lessons, tmp_path_factory):
    out = tmp_path_factory.mktemp("builds")
    return {kind: (out / kind, dict(build_mine.build(folder, out / kind))) for kind, folder in lessons.items()}


@pytest.fixture(scope="module")
def reference_tokens(tmp_path_factory):
    return greedy(ROOT, tmp_path_factory.mktemp("run"))


def test_every_generated_module_is_in_the_table(builds):
    expected = set(solution_modules())
    for _, rows in builds.values():
        assert set(rows) == expected


def test_pristine_lessons_take_every_exercised_module_from_the_reference(builds, tmp_path):
    out, rows = builds["pristine"]
    for name, (notebook, exercised) in solution_modules().items():
        source = rows[name]
        if exercised:
            assert source.startswith(f"reference (lesson {notebook[:2]}: exercise "), (name, source)
            assert source.endswith(" not done)")
        else:  # nothing to solve: the lesson's given code, as it was handed out
            assert source == f"yours (lesson {notebook[:2]}, same code as the reference)", (name, source)
        built = (out / ex.module_path(name)).read_text()
        reference = (ROOT / ex.module_path(name)).read_text()
        assert built == reference if exercised else (built.startswith("# BUILT by `make mine`")
                                                     and build_mine.body(built) == build_mine.body(reference))
    table = (out / "MINE.txt").read_text()  # the table, also written next to the package
    assert all(f"{name}  " in table and source in table for name, source in rows.items())


def test_solved_lessons_build_the_reference_code(builds):
    out, rows = builds["solved"]
    for name, (notebook, _) in solution_modules().items():
        assert rows[name] == f"yours (lesson {notebook[:2]}, same code as the reference)"
        assert build_mine.body((out / ex.module_path(name)).read_text()) == \
            build_mine.body((ROOT / ex.module_path(name)).read_text())
    hand_written = [p.relative_to(ROOT) for p in (ROOT / "nanoserve").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts and not p.read_bytes().startswith(b"# AUTO")]
    assert hand_written and all((out / p).read_bytes() == (ROOT / p).read_bytes() for p in hand_written)


def test_a_pristine_lesson_among_solved_ones_comes_from_the_reference(builds):
    out, rows = builds["partial"]
    for name, (notebook, exercised) in solution_modules().items():
        if notebook.startswith("03_") and exercised:
            assert rows[name].startswith("reference (lesson 03: exercise 3."), rows[name]
        else:
            assert rows[name].startswith(f"yours (lesson {notebook[:2]}"), rows[name]
        assert build_mine.body((out / ex.module_path(name)).read_text()) == \
            build_mine.body((ROOT / ex.module_path(name)).read_text())


def test_the_build_generates_the_reference_greedy_tokens(builds, reference_tokens, tmp_path):
    """The solved build runs: every generated module under make mine's header, imported from PYTHONPATH. (The
    pristine and partial builds hold the same code, each module either the reference's file or under the same
    header, as the tests above assert: their tokens are these.)"""
    assert greedy(builds["solved"][0], tmp_path) == reference_tokens


def edited_copy(solved, tmp_path, lesson: str, exercise: str, old: str, new: str):
    """A copy of the solved lessons in which exercise `exercise`'s cell of lesson `lesson` has old -> new."""
    copy = tmp_path / "lessons"
    shutil.copytree(solved, copy)
    path = next(copy.glob(f"{lesson}_*.ipynb"))
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and f"### BEGIN SOLUTION Exercise {exercise}" in c.source)
    cell.source = cell.source.replace(old, new, 1)
    nbformat.write(nb, path)
    return copy


def test_a_stub_that_does_not_compile_or_a_missing_lesson_falls_back(lessons, tmp_path):
    broken = edited_copy(lessons["solved"], tmp_path, "02", "2.1", "### END SOLUTION", "### END SOLUTION\n    def (")
    (broken / "06_cuda_graphs.ipynb").unlink()
    rows = dict(build_mine.build(broken, tmp_path / "out"))
    assert rows["kernels.contiguous"].startswith("reference (lesson 02: your code does not compile: line ")
    assert rows["model.qwen3_fused"] == "reference (lesson 06: no 06_cuda_graphs.ipynb in " + str(broken) + ")"
    rows = dict(build_mine.build(lessons["solved"], tmp_path / "out"))  # a rebuild replaces the old build
    assert rows["kernels.contiguous"].startswith("yours")


def test_the_learners_code_is_what_runs(lessons, reference_tokens, tmp_path):
    """A wrong answer in a solved lesson changes the build's tokens: the build runs the lesson's code."""
    wrong = edited_copy(lessons["solved"], tmp_path, "01", "1.1", "return weight * x32.to(x.dtype)",
                        "return -weight * x32.to(x.dtype)")
    rows = dict(build_mine.build(wrong, tmp_path / "out"))
    assert rows["model.qwen3"] == "yours (lesson 01)"  # solved, but not the reference's code
    assert greedy(tmp_path / "out", tmp_path, fused=[False])["fused_ops=False"] != reference_tokens["fused_ops=False"]


def test_the_command_it_prints_is_the_readmes(lessons, tmp_path, capsys):
    """make mine ends with how to run the build: the README's command (SmolLM2's real weights answer it)."""
    out = tmp_path / "mine"
    assert build_mine.main(["--lessons-dir", str(lessons["pristine"]), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"run it: PYTHONPATH={out.resolve()} {build_mine.RUN}"
    assert f"PYTHONPATH=build/mine {build_mine.RUN}\n" in (ROOT / "README.md").read_text()
    assert "--model smollm2-135m-instruct" in build_mine.__doc__ and "tiny-qwen3" not in build_mine.__doc__

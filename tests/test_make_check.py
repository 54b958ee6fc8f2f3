"""`make check` (tools/check_lessons.py) on lessons/ copies in a temporary folder: the pristine stubs fail every
exercise, each named; the solved notebooks pass them all; a learner's broken cell is reported for its lesson.

All six lessons run twice (stubs, solutions): about 40 s on a 2-core CPU, each lesson in its own process.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lesson_source import ROOT, export

LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
BIN = Path(sys.executable).parent


def exercises(lesson: str) -> list[str]:
    return list(importlib.import_module(f"nanoserve.checks.lesson{lesson[:2]}").EXERCISES)


def make_check(folder: Path, *lessons: str) -> subprocess.CompletedProcess:
    """`make check LESSONS=folder [LESSON=...]` with this interpreter (the tool itself where make is missing)."""
    if shutil.which("make") and (BIN / "python").exists():
        command = ["make", "--no-print-directory", "check", f"BIN={BIN}", f"LESSONS={folder}"]
        command += [f"LESSON={' '.join(lessons)}"] if lessons else []
    else:
        command = [sys.executable, "tools/check_lessons.py", "--lessons-dir", str(folder), *lessons]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


def rows(stdout: str) -> dict[str, str]:
    """Exercise (or "(notebook)") -> its result column, for every row of the table."""
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"^(\S*)\s+(\(\w+\)|\d+\.\d+ .+?)\s{2,}([✓✗].*)$", line)
        if match:
            lesson, name, result = match.groups()
            found[f"{lesson} {name}" if name.startswith("(") else name] = result  # "04_prefix_caching (notebook)"
    return found


def write_lessons(folder: Path, source: str) -> None:
    """lessons/ as the exporter generates it now ("pristine") or the solved notebooks ("solved")."""
    generated = export.generate(ROOT) if source == "pristine" else None
    for name in LESSONS:
        text = (generated[Path("lessons", f"{name}.ipynb")] if generated
                else (ROOT / "solutions" / f"{name}.ipynb").read_text(encoding="utf-8"))
        (folder / f"{name}.ipynb").write_text(text, encoding="utf-8")


def test_untouched_stubs_fail_every_exercise_each_named(tmp_path):
    write_lessons(tmp_path, "pristine")
    result = make_check(tmp_path)
    table = rows(result.stdout)
    assert result.returncode != 0, result.stdout
    names = [name for lesson in LESSONS for name in exercises(lesson)]
    assert sorted(table) == sorted(names), result.stdout + result.stderr[-2000:]  # one row each, no broken cell
    for name in names:  # each row says which stub to write: its own, or an earlier one its check reaches first
        assert re.match(r"✗ (not done yet|needs \d+\.\d+ first): Exercise \d+\.\d+", table[name]), (name, table[name])
        number = name.split()[0]
        if not table[name].startswith("✗ needs"):
            assert f"Exercise {number}" in table[name], (name, table[name])
    assert f"0 passed, {len(names)} failed" in result.stdout


def test_solved_notebooks_pass_every_exercise(tmp_path):
    write_lessons(tmp_path, "solved")
    result = make_check(tmp_path)
    table = rows(result.stdout)
    names = [name for lesson in LESSONS for name in exercises(lesson)]
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert table == {name: "✓" for name in names}
    assert f"{len(names)} passed, 0 failed" in result.stdout


def test_a_broken_cell_is_reported_against_its_lesson(tmp_path):
    for name in ("03_paged_attention", "04_prefix_caching"):
        shutil.copy(ROOT / "solutions" / f"{name}.ipynb", tmp_path)
    nb = tmp_path / "04_prefix_caching.ipynb"
    text = nb.read_text(encoding="utf-8")
    assert text.count("def prefix_hashes(") == 1
    nb.write_text(text.replace("def prefix_hashes(", "def prefix_hashes((", 1), encoding="utf-8")  # a typo
    (tmp_path / "02_kv_cache.ipynb").write_text('{"cells": [', encoding="utf-8")  # a notebook saved half-way

    result = make_check(Path(os.path.relpath(tmp_path, ROOT)), "02", "03", "04")  # a folder relative to the repository
    table = rows(result.stdout)
    assert result.returncode != 0
    assert re.match(r"✗ cell \d+, line \d+: SyntaxError", table["04_prefix_caching (notebook)"]), result.stdout
    assert table["4.1 prefix_hashes"].startswith("✗ missing: prefix_hashes is not defined (its cell raised"), result.stdout
    assert table["02_kv_cache (notebook)"].startswith("✗ the notebook does not parse"), result.stdout
    assert all(table[name] == "✓" for name in exercises("03_paged_attention")), result.stdout  # other lessons unharmed
    assert not any(name.startswith("01") or name.startswith("1.") for name in table)  # only the lessons asked for

"""`make check` (tools/check_lessons.py) on lessons/ copies in a temporary folder: the pristine stubs fail every
exercise, each named; the solved notebooks pass them all; a learner's broken cell is reported for its lesson,
named as JupyterLab lets one find it (its exercise, or its first line); a long message is cut and says how to
see all of it (FULL=1); a check that fails in an earlier exercise's code says "needs X.Y first".

Every lesson runs twice (stubs, solutions), each in its own process; the other tests run two or three lessons.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from lesson_source import ROOT, export

sys.path.insert(0, str(ROOT / "tools"))
import check_lessons  # noqa: E402

LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
BIN = Path(sys.executable).parent


def exercises(lesson: str) -> list[str]:
    return list(importlib.import_module(f"nanoserve.checks.lesson{lesson[:2]}").EXERCISES)


def make_check(folder: Path, *lessons: str, full: bool = False) -> subprocess.CompletedProcess:
    """`make check LESSONS=folder [LESSON=...] [FULL=1]` with this interpreter (the tool itself where make is
    missing: --full for FULL=1)."""
    env = {k: v for k, v in os.environ.items() if k != "FULL"}
    if shutil.which("make") and (BIN / "python").exists():
        command = ["make", "--no-print-directory", "check", f"BIN={BIN}", f"LESSONS={folder}"]
        command += [f"LESSON={' '.join(lessons)}"] if lessons else []
        command += ["FULL=1"] if full else []  # make exports its command line's variables to the tool
    else:
        command = [sys.executable, "tools/check_lessons.py", "--lessons-dir", str(folder), *lessons]
        command += ["--full"] if full else []
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def rows(stdout: str) -> dict[str, str]:
    """Exercise (or "(notebook)") -> its result column, for every row of the table."""
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"^(\S*)\s+(\(\w+\)|\d+\.\d+ .+?)\s{2,}([✓✗].*)$", line)
        if match:
            lesson, name, result = match.groups()
            found[f"{lesson} {name}" if name.startswith("(") else name] = result  # "04_prefix_caching (notebook)"
    return found


def write_lessons(folder: Path, source: str, lessons: list[str] | None = None) -> None:
    """lessons/ as the exporter generates it now ("pristine") or the solved notebooks ("solved")."""
    generated = export.generate(ROOT) if source == "pristine" else None
    for name in lessons or LESSONS:
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
    # Two lessons through the tool: nbval runs every solved notebook's check cells (CI's time)
    some = ["03_paged_attention", "05_scheduler"]
    write_lessons(tmp_path, "solved", some)
    result = make_check(tmp_path)
    table = rows(result.stdout)
    names = [name for lesson in some for name in exercises(lesson)]
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
    # the cell named by its exercise (JupyterLab numbers no cells), the line counted in the cell
    assert re.match(r"✗ cell of Exercise 4\.1, line \d+: SyntaxError", table["04_prefix_caching (notebook)"]), result.stdout
    assert table["4.1 prefix_hashes"].startswith("✗ missing: prefix_hashes is not defined (its cell raised"), result.stdout
    for name in ("4.2 lookup on allocate", "4.3 reference-counted free"):  # their cell raised for want of 4.1's
        assert table[name].startswith("✗ needs 4.1 first: its cell raised, so PrefixCachingBlockManager's did too"), \
            result.stdout
    assert table["02_kv_cache (notebook)"].startswith("✗ the notebook does not parse"), result.stdout
    assert all(table[name] == "✓" for name in exercises("03_paged_attention")), result.stdout  # other lessons unharmed
    assert not any(name.startswith("01") or name.startswith("1.") for name in table)  # only the lessons asked for


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")


def test_messages_name_cells_cut_long_ones_and_say_which_earlier_exercise_to_fix_first(tmp_path):
    for name in ("01_naive_forward", "04_prefix_caching"):
        shutil.copy(ROOT / "solutions" / f"{name}.ipynb", tmp_path)
    # 1.1 computes wrong numbers: 1.5 and 1.6 run it (no error raised in its code: the checks' results differ)
    edit(tmp_path / "01_naive_forward.ipynb", "keepdim=True) + eps)", "keepdim=True) + 1.0)")
    # 4.1 raises inside the learner's code, which 4.2 and 4.3 run; a cell without an exercise raises a long message
    lesson04 = tmp_path / "04_prefix_caching.ipynb"
    edit(lesson04, "parent = block_hash(parent, token_ids[start:start + block_size])",
         "parent = block_hash(parent, token_ids[start:start + block_size], 0)")
    edit(lesson04, '"    block_manager_cls = PrefixCachingBlockManager"',
         '"    block_manager_cls = PrefixCachingBlockManager\\n",\n'
         '    "raise ValueError(\\"a long message that goes on \\" * 6 + \\"and ends here\\")"')

    result = make_check(tmp_path, "01", "04")
    table = rows(result.stdout)
    assert result.returncode != 0, result.stdout + result.stderr[-2000:]
    assert not re.search(r"\bcell \d+\b", result.stdout), result.stdout  # no count of cells JupyterLab does not show
    assert table["1.1 rms_norm"].startswith("✗ fails: rms_norm"), result.stdout
    assert all(table[name] == "✓" for name in ("1.2 apply_rope", "1.3 causal_attention", "1.4 MLP")), result.stdout
    assert table["1.5 DecoderLayer"].startswith("✗ needs 1.1 first (this check runs its code); fails: "), result.stdout
    assert table["1.6 model"].startswith("✗ needs 1.1 and 1.5 first (this check runs their code); fails: "), result.stdout
    assert table["4.1 prefix_hashes"].startswith("✗ fails: TypeError: block_hash() takes 2 positional"), result.stdout
    for name in ("4.2 lookup on allocate", "4.3 reference-counted free"):
        assert table[name].startswith("✗ needs 4.1 first (this check runs its code); fails: TypeError: "), result.stdout
    for name in ("4.1 prefix_hashes", "4.2 lookup on allocate", "4.3 reference-counted free"):
        assert re.search(r"…? \(cell of Exercise 4\.1, line \d+\)" + re.escape(check_lessons.MORE) + "$",
                         table[name]), table[name]  # cut before the place, which is kept
    notebook = table["04_prefix_caching (notebook)"]  # no exercise: the cell's first line of code, quoted and cut
    assert re.match(r'✗ cell "from nanoserve\.cache\.paged import \w+…", line \d+: ValueError: a long message',
                    notebook), notebook
    assert notebook.endswith("…" + check_lessons.MORE) and "ends here" not in notebook, notebook
    assert len(notebook) <= len("✗ ") + check_lessons.WIDTH + len(check_lessons.MORE), notebook

    whole = rows(make_check(tmp_path, "04", full=True).stdout)  # make check FULL=1: nothing cut
    assert re.fullmatch(r"✗ fails: TypeError: block_hash\(\) takes 2 positional arguments but 3 were given "
                        r"\(cell of Exercise 4\.1, line \d+\)", whole["4.1 prefix_hashes"]), whole
    assert whole["04_prefix_caching (notebook)"].endswith("a long message that goes on " * 6 + "and ends here")
    for name in ("4.2 lookup on allocate", "4.3 reference-counted free"):
        assert re.search(r"fails: TypeError: block_hash\(\) takes 2 positional arguments but 3 were given "
                         r"\(cell of Exercise 4\.1, line \d+\)$", whole[name]), whole[name]
    assert not any(check_lessons.MORE in result for result in whole.values()), whole


def test_render_cuts_at_width_and_full_keeps_every_line():
    long, place = "fails: " + "x" * 200, "cell of Exercise 1.1, line 3"
    (short,) = check_lessons.render(long, place, full=False)
    assert short.endswith(f"… ({place})" + check_lessons.MORE) and len(short) <= check_lessons.WIDTH + len(check_lessons.MORE)
    assert check_lessons.render(long, place, full=True) == [f"{long} ({place})"]
    assert check_lessons.render("fails: two\nlines", "", full=False) == ["fails: two" + check_lessons.MORE]
    assert check_lessons.render("fails: two\nlines", "", full=True) == ["fails: two", "lines"]
    assert check_lessons.render("fails: short", "", full=False) == ["fails: short"]

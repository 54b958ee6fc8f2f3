"""`make check` (tools/check_lessons.py) on lessons/ copies in a temporary folder: the pristine stubs fail every
exercise, each named; the solved notebooks pass them all; a learner's broken cell is reported for its lesson,
named as JupyterLab lets one find it (its exercise, or its first line); a long message is cut and says how to
see all of it (FULL=1); a check that fails in an earlier exercise's code says "needs X.Y first"; a lesson out
of time names what was running, its limit and how to raise it; and each of the learners' mistakes listed below
fails the exercise that made it, and no other (but those that say they need it first).

Every lesson runs twice (stubs, solutions), each in its own process; the other tests run one to three lessons.
"""
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lesson_source import ROOT, export

sys.path.insert(0, str(ROOT / "tools"))
import check_lessons  # noqa: E402

LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
BIN = Path(sys.executable).parent


def exercises(lesson: str) -> list[str]:
    return list(importlib.import_module(f"nanoserve.checks.lesson{lesson[:2]}").EXERCISES)


def make_check(folder: Path, *lessons: str, full: bool = False, timeout: int | None = None
               ) -> subprocess.CompletedProcess:
    """`make check LESSONS=folder [LESSON=...] [FULL=1] [CHECK_TIMEOUT=...]` with this interpreter (the tool itself
    where make is missing: --full for FULL=1, --timeout for CHECK_TIMEOUT)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FULL", "CHECK_TIMEOUT")}
    if shutil.which("make") and (BIN / "python").exists():
        command = ["make", "--no-print-directory", "check", f"BIN={BIN}", f"LESSONS={folder}"]
        command += [f"LESSON={' '.join(lessons)}"] if lessons else []
        command += ["FULL=1"] if full else []  # make exports its command line's variables to the tool
        command += [f"CHECK_TIMEOUT={timeout}"] if timeout else []
    else:
        command = [sys.executable, "tools/check_lessons.py", "--lessons-dir", str(folder), *lessons]
        command += ["--full"] if full else []
        command += ["--timeout", str(timeout)] if timeout else []
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
    assert table["4.2 lookup on allocate"].startswith(
        "✗ needs 4.1 first (this check runs its code); fails: TypeError: "), result.stdout
    assert table["4.3 reference-counted free"] == "✓", result.stdout  # its check runs no code of 4.1's
    for name in ("4.1 prefix_hashes", "4.2 lookup on allocate"):
        assert re.search(r"…? \(cell of Exercise 4\.1, line \d+\)" + re.escape(check_lessons.MORE) + "$",
                         table[name]), table[name]  # cut before the place, which is kept
    notebook = table["04_prefix_caching (notebook)"]  # no exercise: the cell's first line of code, quoted and cut
    cell = next("".join(c["source"]) for c in json.loads(lesson04.read_text(encoding="utf-8"))["cells"]
                if "a long message" in "".join(c["source"]))
    first = check_lessons.first_code_line(cell)
    assert len(first) > check_lessons.LABEL, first  # long enough to be cut
    assert notebook.startswith(f'✗ cell "{first[:check_lessons.LABEL - 1]}…", line '), notebook
    assert re.match(r'✗ cell "[^"]+", line \d+: ValueError: a long message', notebook), notebook
    assert notebook.endswith("…" + check_lessons.MORE) and "ends here" not in notebook, notebook
    assert len(notebook) <= len("✗ ") + check_lessons.WIDTH + len(check_lessons.MORE), notebook

    whole = rows(make_check(tmp_path, "04", full=True).stdout)  # make check FULL=1: nothing cut
    assert re.fullmatch(r"✗ fails: TypeError: block_hash\(\) takes 2 positional arguments but 3 were given "
                        r"\(cell of Exercise 4\.1, line \d+\)", whole["4.1 prefix_hashes"]), whole
    assert whole["04_prefix_caching (notebook)"].endswith("a long message that goes on " * 6 + "and ends here")
    assert re.search(r"fails: TypeError: block_hash\(\) takes 2 positional arguments but 3 were given "
                     r"\(cell of Exercise 4\.1, line \d+\)$", whole["4.2 lookup on allocate"]), whole
    assert not any(check_lessons.MORE in result for result in whole.values()), whole


def test_render_cuts_at_width_and_full_keeps_every_line():
    long, place = "fails: " + "x" * 200, "cell of Exercise 1.1, line 3"
    (short,) = check_lessons.render(long, place, full=False)
    assert short.endswith(f"… ({place})" + check_lessons.MORE) and len(short) <= check_lessons.WIDTH + len(check_lessons.MORE)
    assert check_lessons.render(long, place, full=True) == [f"{long} ({place})"]
    assert check_lessons.render("fails: two\nlines", "", full=False) == ["fails: two" + check_lessons.MORE]
    assert check_lessons.render("fails: two\nlines", "", full=True) == ["fails: two", "lines"]
    assert check_lessons.render("fails: short", "", full=False) == ["fails: short"]


def mistake(folder: Path, lesson: str, old: str, new: str) -> None:
    """One learner's mistake in a solved notebook of folder: `old`, found once in one cell's code, becomes `new`."""
    path = folder / f"{lesson}.ipynb"
    book = json.loads(path.read_text(encoding="utf-8"))
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in book["cells"]]
    hits = [i for i, source in enumerate(sources) if old in source]
    assert len(hits) == 1 and sources[hits[0]].count(old) == 1, f"{old!r} is not in {lesson} exactly once"
    book["cells"][hits[0]]["source"] = sources[hits[0]].replace(old, new)
    path.write_text(json.dumps(book, indent=1, ensure_ascii=False), encoding="utf-8")


# Learners' mistakes (the exercise's text in the solution, the learner's), each with the exercise that must fail.
MISTAKES = {
    "1.1 the weight multiplied before the cast back": (
        "01_naive_forward", "return weight * x32.to(x.dtype)", "return (weight * x32).to(x.dtype)"),
    "1.6 RoPE at 0..n-1 whatever the positions": (
        "01_naive_forward", "cos, sin = rope_cos_sin(positions,",
        "cos, sin = rope_cos_sin(torch.arange(len(input_ids)),"),
    "2.3 the prefill recomputes what the cache holds": (
        "02_kv_cache", "[(r.seq_id, c, r.prompt_ids[c:]) for r, c in zip(requests, cached)]",
        "[(r.seq_id, 0, r.prompt_ids) for r in requests]"),
    "4.3 blocks given back without reversed": (
        "04_prefix_caching", "for block in reversed(blocks):", "for block in blocks:"),
    "4.3 unnamed blocks kept evictable": (
        "04_prefix_caching", "                if self.records[block].hash is not None:\n"
                             "                    self.evictable[block] = None\n"
                             "                else:\n"
                             "                    self.free_blocks.append(block)\n",
        "                self.evictable[block] = None\n"),
    "5.2 a preempted sequence queued at the back": (
        "05_scheduler", "self.waiting.appendleft(seq)\n        ### END SOLUTION",
        "self.waiting.append(seq)\n        ### END SOLUTION"),
    "5.3 one token short in a step": (
        "05_scheduler", "known = seq.token_ids[start:start + n]", "known = seq.token_ids[start:start + n - 1]"),
    "6.4 graphs captured with no warm-up run": (
        "06_cuda_graphs", "            forward()  # compiles kernels, settles the allocator\n", ""),
    "7.3 K/V slices counted from the rank's own K/V heads": (
        "07_tensor_parallel", "local.num_heads * D, first_kv_head(config, group) * D\n",
        "local.num_heads * D, group.rank * local.num_kv_heads * D\n"),
    "8.1 the loop reports no metrics": (
        "08_serving", "                self._apply_aborts()\n                self._report()\n",
        "                self._apply_aborts()\n"),
    "8.1 the loop applies no aborts": (
        "08_serving", "                self._apply_aborts()\n                self._report()\n",
        "                self._report()\n"),
}


@pytest.mark.parametrize("what", MISTAKES)
def test_a_mistake_fails_the_exercise_that_made_it(tmp_path, what):
    lesson, old, new = MISTAKES[what]
    number = what.split()[0]
    write_lessons(tmp_path, "solved", [lesson])
    mistake(tmp_path, lesson, old, new)
    table = rows(make_check(tmp_path, lesson[:2], full=True).stdout)
    mine = next(name for name in table if name.startswith(number + " "))
    assert table[mine].startswith("✗ fails: "), table
    needs_mine = re.compile(rf"✗ needs ([\d.]+ and )*{re.escape(number)}\b")
    for name, result in table.items():  # the others pass, or say that they need this one first
        assert name == mine or result == "✓" or needs_mine.match(result), table


def test_a_correct_answer_the_check_did_not_foresee_passes(tmp_path):
    write_lessons(tmp_path, "solved", ["08_serving"])
    mistake(tmp_path, "08_serving", 'return f"data: {data if', 'return f"data:{data if')  # the space is optional
    result = make_check(tmp_path, "08")
    assert result.returncode == 0 and rows(result.stdout)["8.3 sse"] == "✓", result.stdout


def test_a_lesson_out_of_time_names_the_check_running_its_limit_and_how_to_raise_it(tmp_path):
    write_lessons(tmp_path, "solved", ["04_prefix_caching"])
    mistake(tmp_path, "04_prefix_caching", "    hashes, parent = [], None\n",
            "    hashes, parent = [], None\n    import time\n"
            "    while True:  # a learner's loop that never ends (asleep: it takes no CPU from other tests)\n"
            "        time.sleep(1)\n")
    result = make_check(tmp_path, "04", timeout=20)  # lesson 04 takes 2 s on an idle 2-core machine: room for a loaded one
    table = rows(result.stdout)
    assert result.returncode != 0
    assert table["4.1 prefix_hashes"].startswith(
        "✗ timed out at 20 s, the lesson's time limit (make check CHECK_TIMEOUT=40 raises it)"), result.stdout
    assert table["4.2 lookup on allocate"] == table["4.3 reference-counted free"] == \
        "✗ not run: the lesson ran out of time", result.stdout

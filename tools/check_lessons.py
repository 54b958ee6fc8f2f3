#!/usr/bin/env python3
"""`make check`: run every lesson's exercise checks on the learner's code in lessons/.

    python tools/check_lessons.py                   every lessons/NN_*.ipynb
    python tools/check_lessons.py 03                lesson 03 only (make check LESSON=03)
    python tools/check_lessons.py --lessons-dir DIR 01 05

For each lesson, in a fresh Python process of its own (a crash, a hang or a half-imported module in one
lesson cannot touch the next), the notebook's `#| export` code cells -- the code that would become the
lesson's modules -- run in order in one namespace, and then every exercise of the lesson runs its check
from nanoserve.checks.lessonNN.EXERCISES (the same table the test suite runs on the engine's code).

Which code a check sees: the solution notebooks never import a name their own lesson defines (tools/export.py
refuses it), but a learner's notebook may (say, the engine's decode_attention over their own). So a name
that the notebook's own code defines (def, class, assignment) keeps the learner's definition for the checks
even when a later cell imports the engine's one over it; the learner's functions still see their module
globals as the notebook left them, exactly as they do in Jupyter. No list of cells to skip is needed, so a
lesson that grows a section needs nothing here.

It prints a table lesson x exercise -> pass/fail with the first failure's message, and exits 1 if anything
failed (an exercise, a cell that raises, a notebook that does not parse, a lesson that timed out), else 0.
"""
import argparse
import ast
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import TOP_LEVEL_NAME, top_level_names  # noqa: E402
TIMEOUT = 300  # seconds per lesson; each takes well under two minutes on a laptop CPU
WIDTH = 100  # a message longer than this is cut


# ------------------------------------------------------------------ the worker: one lesson, one process

def is_export_cell(source: str) -> bool:
    """`#| export` or `#| export NAME` among the cell's leading `#|` lines (as tools/export.py reads them)."""
    for line in source.split("\n"):
        if not line.startswith("#|"):
            return False
        if (line[2:].split() or [""])[0] == "export":
            return True
    return False


def first_line(text: str) -> str:
    line = next((s.strip() for s in str(text).split("\n") if s.strip()), "")
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def where(exc: BaseException, cells: dict) -> str:
    """' (cell 17, line 4)': the deepest frame of the traceback that runs the notebook's own code."""
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename in cells:
            found = f" ({cells[frame.filename]}, line {frame.lineno})"
    return found


def describe(exc: BaseException, number: str, ns: dict, cells: dict, own: set) -> str:
    """A failed check, in one line: what to do next, then the first line of the error."""
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, (NotImplementedError, AssertionError)):
        cause = cause.__cause__  # Triton's interpreter wraps what a kernel raises in an InterpreterError
    if isinstance(cause, NotImplementedError):
        exc = cause
    if isinstance(exc, NotImplementedError):
        hint = first_line(exc) or "a stub raises NotImplementedError"
        other = re.match(r"Exercise (\d+\.\d+)", hint)
        if other and other.group(1) != number:  # the check reached an earlier exercise's stub first
            return f"needs {other.group(1)} first: {hint}"
        return f"not done yet: {hint}"
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) and exc.args[0] not in ns:
        name = exc.args[0]
        return f"missing: {name} is not defined" + (" (its cell raised: see (notebook))" if name in own
                                                     else " by any #| export cell")
    if isinstance(exc, AssertionError):
        return "fails: " + (first_line(exc) or "AssertionError") + where(exc, cells)
    return f"fails: {type(exc).__name__}: {first_line(exc)}{where(exc, cells)}"


def run_lesson(path: Path) -> list[list]:
    """[[exercise, passed, message], ...] for one lesson notebook; runs the learner's code in this process."""
    import torch  # before triton: on a CPU the Triton kernels of lesson 03 run in Triton's interpreter,
    if not torch.cuda.is_available():  # which must be switched on before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")

    number = path.name[:2]
    try:
        table = importlib.import_module(f"nanoserve.checks.lesson{number}").EXERCISES
    except (ImportError, AttributeError) as e:
        return [["(checks)", False, f"no exercise checks for lesson {number}: {first_line(e)}"]]

    rows = []
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        cells = [(c.get("cell_type"), c.get("source", "")) for c in nb["cells"]]
        cells = [(kind, "".join(src) if isinstance(src, list) else src) for kind, src in cells]
    except Exception as e:  # not JSON, not a notebook
        why = f"the notebook does not parse: {type(e).__name__}: {first_line(e)}"
        return [["(notebook)", False, why]] + [[name, False, "not run: the notebook does not parse"] for name in table]

    ns = {"__name__": f"lesson{number}"}
    learner = {}  # name -> the value the notebook's own code gave it (later engine imports do not replace it)
    own = set()  # every name the notebook's code defines, whether or not its cell ran
    filenames = {}  # code object filename -> "cell N", for messages
    broken = []
    for i, (kind, source) in enumerate(cells):
        if kind != "code" or not is_export_cell(source):
            continue
        label = f"cell {i + 1}"
        filename = f"<{path.stem} {label}>"
        filenames[filename] = label
        try:
            tree = ast.parse(source, filename=filename)
        except SyntaxError as e:
            broken.append(f"{label}, line {e.lineno}: SyntaxError: {e.msg}")
            own |= {a or b for a, b in TOP_LEVEL_NAME.findall(source)}  # what it would define, by eye
            continue
        names = top_level_names(tree)
        own |= names
        before = {name: ns.get(name, ns) for name in names}  # ns itself marks "unbound"
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(tree, filename, "exec"), ns)
        except BaseException as e:  # the learner's cell raises while it defines things; SystemExit too
            if isinstance(e, KeyboardInterrupt):
                raise
            line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == filename), None)
            broken.append(f"{label}{f', line {line}' if line else ''}: {type(e).__name__}: {first_line(e)}")
        for name in names:  # what the cell bound (before it raised, if it did)
            if ns.get(name, ns) is not before[name]:
                learner[name] = ns[name]
    if broken:
        more = f" (and {len(broken) - 1} more cell(s))" if len(broken) > 1 else ""
        rows.append(["(notebook)", False, first_line(f"{broken[0]}{more}")])

    # The learner's definitions; a name whose defining cell failed is missing (not the engine's import).
    view = {name: value for name, value in ns.items() if name not in own}
    view.update(learner)
    for name, check in table.items():
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the checks print ✓ lines of their own
                check(view)
            rows.append([name, True, ""])
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            rows.append([name, False, describe(e, name.split()[0], view, filenames, own)])
    return rows


def worker(path: Path, out: Path) -> int:
    sys.path.insert(0, str(ROOT))  # this repository's nanoserve, whatever is installed
    rows = run_lesson(path)
    out.write_text(json.dumps(rows), encoding="utf-8")
    return 0


# ------------------------------------------------------------------ the driver: every lesson, a table

def find_lessons(folder: Path, wanted: list[str]) -> list[Path]:
    notebooks = sorted(p.resolve() for p in folder.glob("[0-9][0-9]_*.ipynb"))  # the worker runs in their folder
    if not wanted:
        return notebooks
    chosen = []
    for want in wanted:
        key = want.zfill(2) if want.isdigit() else want
        match = [p for p in notebooks if p.name[:2] == key or p.stem == want or p.name == want]
        if not match:
            raise SystemExit(f"check_lessons: no lesson {want!r} in {folder} "
                             f"(there are: {', '.join(p.name[:2] for p in notebooks) or 'none'})")
        chosen += [p for p in match if p not in chosen]
    return chosen


def check_in_subprocess(path: Path, timeout: float) -> list[list]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            result = subprocess.run([sys.executable, __file__, "--worker", str(path), "--out", str(out)],
                                    cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [["(lesson)", False, f"timed out after {timeout:.0f} s (a cell or a check loops?)"]]
        if result.returncode == 0 and out.exists():
            return json.loads(out.read_text(encoding="utf-8"))
        tail = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        return [["(lesson)", False, f"the checker crashed (exit {result.returncode}): "
                                    f"{first_line(tail[-1]) if tail else 'no output'}"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run each lesson's exercise checks on the code in lessons/.")
    parser.add_argument("lessons", nargs="*", metavar="NN", help="lesson numbers (default: all)")
    parser.add_argument("--lessons-dir", type=Path, default=ROOT / "lessons", help="default: lessons/")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per lesson (default %(default)s)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)

    lessons = find_lessons(args.lessons_dir, args.lessons)
    if not lessons:
        print(f"check_lessons: no NN_*.ipynb lessons in {args.lessons_dir}", file=sys.stderr)
        return 2
    width = max(len(p.stem) for p in lessons)
    print(f"{'lesson':<{width}}  {'exercise':<26}  result", flush=True)
    passed = failed = 0
    for path in lessons:
        start = time.monotonic()
        rows = check_in_subprocess(path, args.timeout)
        for i, (name, ok, message) in enumerate(rows):
            lesson = path.stem if i == 0 else ""
            print(f"{lesson:<{width}}  {name:<26}  {'✓' if ok else '✗'} {message}".rstrip(), flush=True)
            passed, failed = passed + ok, failed + (not ok)
        print(f"{'':<{width}}  {'':<26}  ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"make check: {passed} passed, {failed} failed" + ("" if failed else " -- every exercise passes"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`make check`: run every lesson's exercise checks on the learner's code in lessons/.

    python tools/check_lessons.py                   every lessons/NN_*.ipynb
    python tools/check_lessons.py 03                lesson 03 only (make check LESSON=03)
    python tools/check_lessons.py --lessons-dir DIR 01 05
    python tools/check_lessons.py --full 03         messages whole, not cut (make check FULL=1 LESSON=03)
    python tools/check_lessons.py --timeout 600     a longer time limit per lesson (make check CHECK_TIMEOUT=600)

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
A message names a cell the way JupyterLab lets a learner find it: "cell of Exercise 1.1" (the code cell
with that exercise's stub, or the one its hint follows), else the cell's first line of code, quoted. A
message longer than WIDTH is cut and says so; --full (or FULL=1 in the environment: `make check FULL=1`
passes it, as make exports the variables of its command line to the commands it runs) prints it whole.
A check that fails because it runs an earlier exercise's code, and that exercise is a stub or fails its
own check (or its cell raised), says "needs X.Y first".

A lesson has TIMEOUT seconds; CHECK_TIMEOUT in the environment (`make check CHECK_TIMEOUT=600`) or --timeout
changes that, and raising it raises the time limits of the checks themselves alike (nanoserve.checks.time_limit:
a rank or a request a check waits for). A lesson that runs out of time names the cell or the check that was
running, the limit, and how to raise it (on a slow or busy machine a check may just need longer).
"""
import argparse
import ast
import contextlib
import functools
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import TOP_LEVEL_NAME, top_level_names  # noqa: E402
TIMEOUT = 300  # seconds per lesson, as nanoserve.checks.LESSON_TIME_LIMIT; a lesson takes seconds on a laptop
WIDTH = 100  # a message longer than this is cut (unless --full)
MORE = " (cut: make check FULL=1 shows all)"  # ends a cut message
LABEL = 40  # a cell's first line, quoted in a message, is cut to this many characters
STUB = re.compile(r"""NotImplementedError\(\s*["']Exercise (\d+\.\d+\w*)""")
HINT = re.compile(r"<summary>\s*Hints? for exercises? (\d+\.\d+\w*)", re.I)


# ------------------------------------------------------------------ the worker: one lesson, one process

def is_export_cell(source: str) -> bool:
    """`#| export` or `#| export NAME` among the cell's leading `#|` lines (as tools/export.py reads them)."""
    for line in source.split("\n"):
        if not line.startswith("#|"):
            return False
        if (line[2:].split() or [""])[0] == "export":
            return True
    return False


def cell_exercises(cells: list, i: int) -> list[str]:
    """The exercises of code cell i: its stubs', and those whose hints the markdown cells after it hold."""
    found = STUB.findall(cells[i][1])
    for kind, source in cells[i + 1:]:
        if kind == "code":
            break
        found += HINT.findall(source)
    return sorted(set(found), key=exercise_order)


def exercise_order(number: str) -> tuple:
    """ "3.1b" -> (3, 1, "b") """
    lesson, exercise, part = re.fullmatch(r"(\d+)\.(\d+)(\w*)", number).groups()
    return int(lesson), int(exercise), part


def first_code_line(source: str) -> str:
    """The cell's first line of code: not a `#|` directive, a comment, a blank line or a docstring."""
    lines = source.split("\n")
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return lines[start - 1].strip()
    return next((s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")), "")


def cell_label(exercises: list[str], source: str) -> str:
    """How a learner finds the cell in JupyterLab, which numbers no cells: its exercise, or its first line."""
    if exercises:
        return "cell of Exercise " + "/".join(exercises)
    line = first_code_line(source)
    return f'cell "{line if len(line) <= LABEL else line[:LABEL - 1] + "…"}"'


def notebook_frames(exc: BaseException, cells: dict) -> list:
    """The traceback's frames in the notebook's own code, outermost first (chained exceptions too)."""
    frames, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames += [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in cells]
        exc = exc.__cause__ or exc.__context__
    return frames


def where(exc: BaseException, cells: dict) -> str:
    """'cell of Exercise 1.1, line 4': the deepest frame of the traceback that runs the notebook's own code."""
    frames = notebook_frames(exc, cells)
    return f"{cells[frames[-1].filename]['label']}, line {frames[-1].lineno}" if frames else ""


def row_number(exercise: str, numbers: list[str]) -> str | None:
    """The exercise table's number for a cell's exercise: "3.1a" -> "3.1" (the table checks 3.1a and 3.1b as one)."""
    for number in numbers:
        if exercise == number or (exercise.startswith(number) and exercise[len(number):].isalpha()):
            return number
    return None


def describe(exc: BaseException, number: str, ns: dict, cells: dict, own: set) -> tuple[str, str]:
    """A failed check: (what to do next, then the error's message; where in the notebook, or "")."""
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, (NotImplementedError, AssertionError)):
        cause = cause.__cause__  # Triton's interpreter wraps what a kernel raises in an InterpreterError
    if isinstance(cause, NotImplementedError):
        exc = cause
    if isinstance(exc, NotImplementedError):
        hint = str(exc).strip() or "a stub raises NotImplementedError"
        other = re.match(r"Exercise (\d+\.\d+)", hint)
        if other and other.group(1) != number:  # the check reached an earlier exercise's stub first
            return f"needs {other.group(1)} first: {hint}", ""
        return f"not done yet: {hint}", ""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) and exc.args[0] not in ns:
        name = exc.args[0]
        return f"missing: {name} is not defined" + (" (its cell raised: see (notebook))" if name in own
                                                     else " by any #| export cell"), ""
    if isinstance(exc, AssertionError):
        return "fails: " + (str(exc).strip() or "AssertionError"), where(exc, cells)
    return f"fails: {type(exc).__name__}: {str(exc).strip()}", where(exc, cells)


def missing_name(exc: BaseException, ns: dict) -> str | None:
    """The name a KeyError (the check's ns[...]) or a NameError (the learner's code) did not find."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) and exc.args[0] not in ns:
        return exc.args[0]
    if isinstance(exc, NameError):
        return getattr(exc, "name", None) or (re.findall(r"name '(\w+)' is not defined", str(exc)) or [None])[0]
    return None


def reached_cells(check, view: dict, cells: dict) -> set:
    """The notebook cells whose code a check runs: the check again, with a trace function on every new frame."""
    reached = set()

    def trace(frame, event, arg):
        if frame.f_code.co_filename in cells:
            reached.add(frame.f_code.co_filename)
        return None  # no line events: only which functions start

    old, old_threads = sys.gettrace(), threading.gettrace()
    threading.settrace(trace)
    sys.settrace(trace)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(view)
    except KeyboardInterrupt:
        raise
    except BaseException:
        pass  # it fails again, as it did the first time; what it reached up to then is what counts
    finally:
        sys.settrace(old)
        threading.settrace(old_threads)
    return reached


def earlier_failures(exc, number, check, view, cells, defined_in, failed, numbers) -> tuple[list[str], str, bool]:
    """The earlier exercises (table numbers) whose fault this failed check may be, why, and whether the check's
    own error is worth showing too: a name the check misses is defined by their cell, which raised (or by a
    cell their raising cell stopped); or the check runs their code, and their own checks fail."""
    earlier = set(numbers[:numbers.index(number)]) & set(failed)

    def theirs(filename):  # the earlier failed exercises of a cell, unless it is also this exercise's cell
        mine = {row_number(e, numbers) for e in cells[filename]["exercises"]}
        return [] if number in mine else [n for n in mine if n in earlier]

    def ordered(found):
        return sorted(set(found), key=numbers.index)

    name = missing_name(exc, view)
    if name in defined_in and cells[defined_in[name]]["raised"]:
        chain = [defined_in[name]]  # its cell, and the earlier cells that made it raise (a name they define)
        while cells[chain[-1]].get("because") and cells[chain[-1]]["because"] not in chain:
            chain.append(cells[chain[-1]]["because"])
        found = [n for filename in chain for n in theirs(filename)]
        why = (f"its cell raised, and it defines {name}" if found and found == theirs(chain[0])
               else f"its cell raised, so {name}'s did too")
        return ordered(found), why + " (see (notebook))", False
    why = "this check runs its code"
    found = [n for f in notebook_frames(exc, cells) for n in theirs(f.filename)]
    if not found and any(theirs(filename) for filename in cells):  # the error is not raised in their code,
        found = [n for filename in reached_cells(check, view, cells) for n in theirs(filename)]  # but is it theirs?
    return ordered(found), why, True


def blocked_by(name, filename: str, cells: dict, binds: dict) -> str | None:
    """The latest earlier cell that raised and would have bound the name a cell's NameError misses."""
    for other in reversed(list(cells)[:list(cells).index(filename)]):
        if name and cells[other]["raised"] and (name in binds[other] if binds[other] is not None
                                                else re.search(rf"\b{re.escape(name)}\b", cells[other]["source"])):
            return other
    return None


def run_lesson(path: Path, progress=None) -> list[list]:
    """[[exercise, passed, message, where], ...] for one lesson notebook; runs the learner's code here.
    progress(rows so far, what runs now, the lesson's exercises) is called before each cell and each check:
    the driver, which stops this process when its time is up, learns from it what was running."""
    import torch  # before triton: on a CPU the Triton kernels of lesson 03 run in Triton's interpreter,
    if not torch.cuda.is_available():  # which must be switched on before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")

    number = path.name[:2]
    try:
        table = importlib.import_module(f"nanoserve.checks.lesson{number}").EXERCISES
    except (ImportError, AttributeError) as e:
        return [["(checks)", False, f"no exercise checks for lesson {number}: {e}", ""]]

    rows = []
    names = list(table)
    progress = functools.partial(progress, names=names) if progress else lambda rows, running: None
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        cells = [(c.get("cell_type"), c.get("source", "")) for c in nb["cells"]]
        cells = [(kind, "".join(src) if isinstance(src, list) else src) for kind, src in cells]
    except Exception as e:  # not JSON, not a notebook
        why = f"the notebook does not parse: {type(e).__name__}: {e}"
        return [["(notebook)", False, why, ""]] + [[name, False, "not run: the notebook does not parse", ""]
                                                   for name in table]

    ns = {"__name__": f"lesson{number}"}
    learner = {}  # name -> the value the notebook's own code gave it (later engine imports do not replace it)
    own = set()  # every name the notebook's code defines, whether or not its cell ran
    defined_in = {}  # name -> the code filename of the last cell that defines it
    binds = {}  # code filename -> the names the cell binds, imports included (None: it does not parse)
    compiled = {}  # code object filename -> {"label", "exercises", "raised", ...}, for messages
    broken = []
    for i, (kind, source) in enumerate(cells):
        if kind != "code" or not is_export_cell(source):
            continue
        exercises = cell_exercises(cells, i)
        label = cell_label(exercises, source)
        filename = f"<{path.stem} cell {i + 1}>"  # unique; a learner reads the label
        compiled[filename] = {"label": label, "exercises": exercises, "raised": False, "source": source}
        try:
            tree = ast.parse(source, filename=filename)
        except SyntaxError as e:
            broken.append(f"{label}, line {e.lineno}: SyntaxError: {e.msg}")
            compiled[filename]["raised"] = True
            names = {a or b for a, b in TOP_LEVEL_NAME.findall(source)}  # what it would define, by eye
            own |= names
            defined_in.update(dict.fromkeys(names, filename))
            binds[filename] = None
            continue
        names = top_level_names(tree)
        own |= names
        defined_in.update(dict.fromkeys(names, filename))
        binds[filename] = names | {(a.asname or a.name).split(".")[0] for node in tree.body
                                   if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
        before = {name: ns.get(name, ns) for name in names}  # ns itself marks "unbound"
        progress(rows, label)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(tree, filename, "exec"), ns)
        except BaseException as e:  # the learner's cell raises while it defines things; SystemExit too
            if isinstance(e, KeyboardInterrupt):
                raise
            compiled[filename]["raised"] = True
            compiled[filename]["because"] = blocked_by(missing_name(e, ns), filename, compiled, binds)
            line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == filename), None)
            broken.append(f"{label}{f', line {line}' if line else ''}: {type(e).__name__}: {str(e).strip()}")
        for name in names:  # what the cell bound (before it raised, if it did)
            if ns.get(name, ns) is not before[name]:
                learner[name] = ns[name]
    if broken:
        more = f" (and {len(broken) - 1} more cell(s))" if len(broken) > 1 else ""
        lines = broken[0].split("\n")
        rows.append(["(notebook)", False, "\n".join([lines[0] + more] + lines[1:] + broken[1:]), ""])

    # The learner's definitions; a name whose defining cell failed is missing (not the engine's import).
    view = {name: value for name, value in ns.items() if name not in own}
    view.update(learner)
    failed = {}  # table number -> True, for the exercises whose checks failed so far (in the table's order)
    numbers = [name.split()[0] for name in table]
    for filename, cell in compiled.items():  # an exercise whose cell raised is broken before its check runs
        for exercise in cell["exercises"] if cell["raised"] else ():
            if row_number(exercise, numbers):
                failed[row_number(exercise, numbers)] = True
    for name, check in table.items():
        number = name.split()[0]
        progress(rows, name)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the checks print ✓ lines of their own
                check(view)
            rows.append([name, True, "", ""])
            failed.pop(number, None)
            continue
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            message, place = describe(e, number, view, compiled, own)
            if not message.startswith(("not done yet", "needs")):  # not a stub: an earlier exercise's fault?
                earlier, why, keep = earlier_failures(e, number, check, view, compiled, defined_in, failed, numbers)
                if earlier:
                    if len(earlier) > 1:
                        why = why.replace("its ", "their ")
                    message = f"needs {' and '.join(earlier)} first" + (f" ({why}); {message}" if keep else f": {why}")
            rows.append([name, False, message, place])
        failed[number] = True
    return rows


def worker(path: Path, out: Path) -> int:
    sys.path.insert(0, str(ROOT))  # this repository's nanoserve, whatever is installed

    def save(rows, running, names=()):  # whole or not at all: the driver may read it as it stops this process
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps({"rows": rows, "running": running, "names": list(names)}), encoding="utf-8")
        os.replace(partial, out)

    save(run_lesson(path, save), None)
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


def stopped(done: dict, why: str, left: str) -> list[list]:
    """The rows of a lesson whose process was stopped (its time was up) or died: those it finished, then what
    was running (a check, or a cell of the notebook) with `why`, then the checks it never reached (`left`)."""
    rows, running, names = done.get("rows", []), done.get("running"), done.get("names", [])
    finished = {row[0] for row in rows}
    if running in names:  # a check
        now = [[running, False, why, ""]]
    elif running:  # a cell of the notebook, by its label
        now = [["(notebook)", False, f"{running}: {why}", ""]]
    else:  # before the first cell: starting Python, importing the checks
        now = [["(lesson)", False, why, ""]]
    return rows + now + [[name, False, f"not run: {left}", ""]
                         for name in names if name not in finished and name != running]


def check_in_subprocess(path: Path, timeout: float) -> list[list]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   CHECK_TIMEOUT=f"{timeout:g}")  # the checks' own limits grow with it (nanoserve.checks)
        try:
            result = subprocess.run([sys.executable, __file__, "--worker", str(path), "--out", str(out)],
                                    cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return stopped(json.loads(out.read_text(encoding="utf-8")) if out.exists() else {},
                           f"timed out at {timeout:.0f} s, the lesson's time limit (make check CHECK_TIMEOUT="
                           f"{2 * timeout:.0f} raises it): a loop that never ends, or a slow or busy machine",
                           "the lesson ran out of time")
        done = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
        if result.returncode == 0 and "running" in done and done["running"] is None:
            return done["rows"]
        tail = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        why = f"the checker crashed (exit {result.returncode}): {tail[-1].strip() if tail else 'no output'}"
        return stopped(done, why + "".join("\n" + line for line in tail[-40:-1]), "the checker crashed first")


def render(message: str, place: str, full: bool) -> list[str]:
    """A row's result as printed: one line cut at WIDTH (saying so), or with --full every line of it, whole."""
    lines = message.rstrip().split("\n") if message else [""]
    suffix = f" ({place})" if place else ""
    if full:
        return [lines[0] + suffix] + lines[1:]
    head = lines[0]
    if len(head) + len(suffix) <= WIDTH and len(lines) == 1:
        return [head + suffix]
    room = max(WIDTH - len(suffix), 40)
    head = head if len(head) <= room else head[:room - 1] + "…"
    return [head + suffix + MORE]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run each lesson's exercise checks on the code in lessons/.")
    parser.add_argument("lessons", nargs="*", metavar="NN", help="lesson numbers (default: all)")
    parser.add_argument("--lessons-dir", type=Path, default=ROOT / "lessons", help="default: lessons/")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds per lesson (default: CHECK_TIMEOUT in the environment, else {TIMEOUT}; "
                             f"make check CHECK_TIMEOUT=600)")
    parser.add_argument("--full", action="store_true",
                        help=f"print messages whole (default: one line, cut at {WIDTH} characters); "
                             "FULL=1 in the environment does the same: make check FULL=1")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    full = args.full or os.environ.get("FULL", "").strip().lower() in ("1", "yes", "true", "on")
    if args.timeout is None:
        try:
            args.timeout = float(os.environ.get("CHECK_TIMEOUT", "").strip() or TIMEOUT)
        except ValueError:
            parser.error(f"CHECK_TIMEOUT={os.environ['CHECK_TIMEOUT']!r}: want a number of seconds")
    if not args.timeout > 0:
        parser.error(f"the time limit must be a positive number of seconds, got {args.timeout:g}")

    lessons = find_lessons(args.lessons_dir, args.lessons)
    if not lessons:
        print(f"check_lessons: no NN_*.ipynb lessons in {args.lessons_dir}", file=sys.stderr)
        return 2
    width = max(len(p.stem) for p in lessons)
    indent = " " * (width + 2 + 26 + 2 + 2)
    print(f"{'lesson':<{width}}  {'exercise':<26}  result", flush=True)
    passed = failed = 0
    for path in lessons:
        start = time.monotonic()
        rows = check_in_subprocess(path, args.timeout)
        for i, (name, ok, message, place) in enumerate(rows):
            lesson = path.stem if i == 0 else ""
            first, *rest = render(message, place, full)
            print(f"{lesson:<{width}}  {name:<26}  {'✓' if ok else '✗'} {first}".rstrip(), flush=True)
            for line in rest:
                print(f"{indent}{line}".rstrip(), flush=True)
            passed, failed = passed + ok, failed + (not ok)
        print(f"{'':<{width}}  {'':<26}  ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"make check: {passed} passed, {failed} failed" + ("" if failed else " -- every exercise passes"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

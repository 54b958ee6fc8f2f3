#!/usr/bin/env python3
"""Mutation testing of the lessons' exercise checks: how many wrong answers does each check catch?

For every exercise region of a solution notebook (the code between `### BEGIN SOLUTION Exercise N.M: ...`
and `### END SOLUTION`), this makes small wrong versions of the solution -- the mistakes a learner makes --
and runs `make check` on each (tools/check_lessons.py, on a copy of solutions/ with that one region
changed). A mutant is *killed* when the check fails (an exercise row, a cell that raises, a time-out) and
*survives* when every check passes; a survivor is either a gap in the checks or a change that does not
alter behaviour (an equivalent mutant), and the diff printed for it lets a person tell which.

Maintainers' tool, not part of `make test`: a lesson takes minutes (one `make check` per mutant).

    python tools/mutate.py                       every lesson (make mutate)
    python tools/mutate.py 03 04 --jobs 2        lessons 03 and 04 (make mutate LESSON=03)
    python tools/mutate.py 03 --max-per-exercise 6 --out /tmp/mutants_03.json
    python tools/mutate.py 03 --dry-run          list the mutants, run nothing
    python tools/mutate.py 02 --exercise 2.5     exercise 2.5's regions only

The mutations, all inside the region (the rest of the cell stays byte-identical): a flipped comparison
(`<`/`<=`, `>`/`>=`, `==`/`!=`, `is`/`is not`, `in`/`not in`), an integer constant or a `+`/`-`
expression off by one, `reversed(x)` or `sorted(x)` replaced by `x`, a forgotten step (a one-argument
method or module call replaced by its argument: `F.silu(x)`, `self.norm(x)` -> `x`), the two names of a
call's arguments or of an index swapped (`f(a, b)`, `cache[rows, positions]`), `append`/`appendleft` and
`pop`/`popleft` (in cells that use a deque), a multiplication or division by a name, attribute or
constant deleted, `and`/`or`, `min`/`max` (also `minimum`/`maximum`), an `if` condition negated, one
assignment or expression statement replaced by `pass`, `True`/`False`, and a slice bound off by one.
`raise` statements (messages) are left alone. At most --max-per-exercise mutants per region, picked
with a fixed seed, taking the kinds in turn.

First each lesson's unmutated solutions must pass its checks (the baseline); a lesson whose baseline
fails is reported and skipped. A mutant gets at most --timeout seconds, and no more than
max(60, 5 x the baseline's time), so one that loops forever costs a minute, not five.
"""
import argparse
import ast
import copy
import difflib
import functools
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tools" / "check_lessons.py"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"

FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
MIN_MAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum"}
DEQUE = {"append": "appendleft", "appendleft": "append", "pop": "popleft", "popleft": "pop"}
# Operands whose multiplication or division a learner forgets: a name, an attribute, a number.
FACTOR = (ast.Name, ast.Attribute, ast.Constant)
# Where an expression sits among arithmetic (or is the object of `.`, `[]`, a call), a replacement for it
# is parenthesised unless it is an atom, so that `x * s` -> `x` cannot change how the code around it groups.
GROUPING = (ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Attribute, ast.Subscript, ast.Call, ast.Await, ast.Starred)


# ------------------------------------------------------------------ regions and mutants (no processes)

def regions(source: str) -> list[tuple[str, int, int]]:
    """(exercise, first line, last line) of each solution region of a cell; lines count from 1 and are the
    code between the markers. The exercise is the BEGIN line's `Exercise N.M`, e.g. '3.1a'."""
    found, opened = [], None
    for n, line in enumerate(source.split("\n"), start=1):
        text = line.strip()
        if text.startswith(BEGIN):
            hint = text[len(BEGIN):].strip()
            name = re.match(r"Exercise\s+(\d+\.\d+\w*)", hint)
            opened = (name.group(1) if name else hint or "?", n)
        elif text.startswith(END) and opened:
            found.append((opened[0], opened[1] + 1, n - 1))
            opened = None
    return found


@dataclass
class Mutant:
    kind: str
    source: str  # the whole cell, mutated
    diff: str  # unified diff of the cell's changed lines


def _text(node: ast.AST, original: ast.AST, parent: ast.AST) -> str:
    """Source for the expression node that replaces `original`, a child of `parent`."""
    text = ast.unparse(node)
    loose = (ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)  # bind more loosely than `and`, `or`, `not`
    if isinstance(parent, ast.BoolOp) or isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
        inside = isinstance(node, loose)
    elif isinstance(parent, ast.Compare):
        inside = isinstance(node, loose + (ast.Compare,)) or isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
    else:
        argument = (isinstance(parent, ast.Call) and parent.func is not original) or (
            isinstance(parent, ast.Subscript) and parent.value is not original)  # an argument, an index: no need
        atom = isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) or (
            isinstance(node, ast.Constant) and not text.startswith("-"))
        inside = isinstance(parent, GROUPING) and not argument and not atom
    return f"({text})" if inside else text


def _changed(node: ast.AST, **fields) -> ast.AST:
    new = copy.deepcopy(node)
    for name, value in fields.items():
        setattr(new, name, value)
    return new


def _plus(node: ast.AST, delta: int) -> ast.AST:
    return ast.BinOp(copy.deepcopy(node), ast.Add() if delta > 0 else ast.Sub(), ast.Constant(1))


def _nodes(tree: ast.AST, first: int, last: int):
    """(node, its parent) for every node lying wholly on lines first..last, except in `raise` statements
    (what an exception says is a message; the condition that raises it is still mutated)."""
    todo = [(tree, None)]
    while todo:
        node, parent = todo.pop()
        if isinstance(node, ast.Raise):
            continue
        if getattr(node, "lineno", 0) >= first and getattr(node, "end_lineno", last + 1) <= last:
            yield node, parent
        todo.extend((child, node) for child in ast.iter_child_nodes(node))


def _candidates(tree: ast.AST, first: int, last: int, uses_deque: bool):
    """(kind, node, the text that replaces it) for every mutation the region admits."""
    for node, up in _nodes(tree, first, last):
        text = functools.partial(_text, original=node, parent=up)  # the source for what replaces node
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in FLIP:
                    ops = node.ops[:i] + [FLIP[type(op)]()] + node.ops[i + 1:]
                    yield "compare", node, text(_changed(node, ops=ops))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):
                yield "off-by-one", node, text(ast.Constant(node.value + delta))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            yield "true-false", node, str(not node.value)
        elif isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Add, ast.Sub)) and not (
                    isinstance(node.right, ast.Constant) and type(node.right.value) is int):  # constants: above
                for delta in (1, -1):
                    yield "off-by-one", node, text(_plus(node, delta))
            if isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv)):
                if isinstance(node.right, FACTOR):
                    yield "drop-mul", node, text(node.left)
                if isinstance(node.op, ast.Mult) and isinstance(node.left, FACTOR):
                    yield "drop-mul", node, text(node.right)
        elif isinstance(node, ast.BoolOp):
            yield "and-or", node, text(_changed(node, op=ast.Or() if isinstance(node.op, ast.And) else ast.And()))
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            if (isinstance(func, ast.Name) and func.id in ("reversed", "sorted") and len(args) == 1
                    and not node.keywords and not isinstance(args[0], ast.Starred)):
                yield "drop-call", node, text(args[0])
            elif (isinstance(func, ast.Attribute) and len(args) == 1 and not node.keywords
                  and not isinstance(args[0], ast.Starred) and not isinstance(up, ast.Expr)):
                yield "drop-step", node, text(args[0])  # a forgotten step: F.silu(x), self.norm(x) -> x
            if len(args) == 2 and all(isinstance(a, ast.Name) for a in args) and args[0].id != args[1].id:
                yield "swap-args", node, text(_changed(node, args=args[::-1]))
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in MIN_MAX:
                yield "min-max", func, ast.unparse(_changed(func, **{
                    "id" if isinstance(func, ast.Name) else "attr": MIN_MAX[name]}))
            if name in DEQUE and isinstance(func, ast.Attribute) and uses_deque:
                yield "deque-end", func, ast.unparse(_changed(func, attr=DEQUE[name]))
        elif isinstance(node, ast.Tuple) and isinstance(up, ast.Subscript) and len(node.elts) == 2 and all(
                isinstance(e, ast.Name) for e in node.elts) and node.elts[0].id != node.elts[1].id:
            yield "swap-args", node, text(_changed(node, elts=node.elts[::-1]))  # cache[rows, positions]
        elif isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                if bound is not None and not (isinstance(bound, ast.Constant) and type(bound.value) is int):
                    for delta in (1, -1):
                        yield "slice", bound, _text(_plus(bound, delta), bound, node)
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            yield "negate-if", node.test, _text(ast.UnaryOp(ast.Not(), copy.deepcopy(node.test)), node.test, node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)) and not (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # a docstring
            yield "drop-statement", node, "pass"


def _located(source: str, node: ast.expr) -> bool:
    """Whether the node's recorded span holds the node (inside f-strings, Python 3.11's columns can be off)."""
    try:
        return ast.dump(ast.parse(ast.get_source_segment(source, node), mode="eval").body) == ast.dump(node)
    except (SyntaxError, TypeError, ValueError):
        return False


def _splice(lines: list[str], node: ast.AST, text: str) -> str:
    """The cell with node's span replaced by text. AST columns count UTF-8 bytes, hence the encoding."""
    a, b = node.lineno - 1, node.end_lineno - 1
    head = lines[a].encode()[:node.col_offset].decode()
    tail = lines[b].encode()[node.end_col_offset:].decode()
    return "\n".join(lines[:a] + [head + text + tail] + lines[b + 1:])


def mutants(source: str, first: int, last: int) -> list[Mutant]:
    """Every distinct mutant of lines first..last of a cell that still compiles (in a fixed order)."""
    try:
        tree = ast.parse(source)  # the markers are comments, so the whole cell parses as it is
    except SyntaxError:
        return []
    lines = source.split("\n")
    uses_deque = any(word in source for word in ("deque", "popleft", "appendleft"))
    seen, out = {source}, []
    for kind, node, text in _candidates(tree, first, last, uses_deque):
        if isinstance(node, ast.expr) and not _located(source, node):
            continue
        new = _splice(lines, node, text)
        if new in seen:
            continue
        try:
            compile(new, "<mutant>", "exec")
        except SyntaxError:
            continue
        seen.add(new)
        diff = difflib.unified_diff(lines, new.split("\n"), "solution", "mutant", n=0, lineterm="")
        out.append(Mutant(kind, new, "\n".join(list(diff)[2:])))  # the hunks; the file names say nothing
    return out


def choose(found: list[Mutant], cap: int, rng: random.Random) -> list[Mutant]:
    """At most cap mutants, taking the kinds in turn (a random pick within each), so one kind that has
    many sites (off-by-one, usually) does not crowd out the others."""
    by_kind: dict[str, list[Mutant]] = {}
    for m in found:
        by_kind.setdefault(m.kind, []).append(m)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)
    for group in by_kind.values():
        rng.shuffle(group)
    chosen = []
    while len(chosen) < cap and any(by_kind.values()):
        for kind in kinds:
            if by_kind[kind] and len(chosen) < cap:
                chosen.append(by_kind[kind].pop())
    return chosen


# ------------------------------------------------------------------ running make check on a mutant

def run_check(solutions: Path, lesson: Path, cell: int | None, source: str | None, timeout: float):
    """(passed, seconds, the first failing line) of check_lessons on lesson, in a copy of solutions/ where
    that cell's source is replaced (cell None: the baseline, nothing replaced)."""
    with tempfile.TemporaryDirectory(prefix="nanoserve-mutant-") as tmp:
        for path in solutions.glob("[0-9][0-9]_*.ipynb"):  # all of them, as lessons may read each other
            shutil.copy(path, tmp)
        if cell is not None:
            nb = json.loads(lesson.read_text(encoding="utf-8"))
            nb["cells"][cell]["source"] = source
            Path(tmp, lesson.name).write_text(json.dumps(nb), encoding="utf-8")
        start = time.monotonic()
        try:
            result = subprocess.run([sys.executable, str(CHECK), "--lessons-dir", tmp, "--timeout", str(timeout),
                                     lesson.name[:2]], capture_output=True, text=True, timeout=timeout + 60)
        except subprocess.TimeoutExpired:  # check_lessons' own time-out did not fire: count it as caught
            return False, time.monotonic() - start, f"timed out after {timeout:.0f} s"
        seconds = time.monotonic() - start
    if result.returncode == 0:
        return True, seconds, ""
    failed = [line for line in result.stdout.splitlines() if "✗" in line]
    tail = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    # A row reads "<lesson>  <exercise>  ✗ message"; drop the lesson's name and the padding.
    first = re.sub(r"\s+", " ", failed[0].replace(lesson.stem, "", 1)).strip() if failed else \
        f"exit {result.returncode}: {tail[-1] if tail else 'no output'}"
    return False, seconds, first


def mutate_lesson(solutions: Path, lesson: Path, args) -> dict:
    """The lesson's baseline and every chosen mutant's result."""
    from tqdm import tqdm

    nb = json.loads(lesson.read_text(encoding="utf-8"))
    planned = []  # (exercise, cell index, Mutant)
    count = Counter()  # a second region of the same exercise (lesson 06 has one) is "6.3#2"
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        for exercise, first, last in regions(source):
            if args.exercise and not exercise.startswith(args.exercise):
                continue
            count[exercise] += 1
            label = exercise if count[exercise] == 1 else f"{exercise}#{count[exercise]}"
            rng = random.Random(f"{args.seed}/{lesson.name[:2]}/{label}")
            planned += [(label, i, m) for m in choose(mutants(source, first, last), args.max_per_exercise, rng)]
    report = {"lesson": lesson.name[:2], "notebook": lesson.name, "mutants": []}
    if args.dry_run:
        for exercise, cell, m in planned:
            print(f"--- {lesson.name[:2]} {exercise} {m.kind} (cell {cell + 1})\n{m.diff}")
        return report

    ok, seconds, first = run_check(solutions, lesson, None, None, args.timeout)
    report["baseline"] = {"passed": ok, "seconds": round(seconds, 1), "first_failure": first}
    if not ok:
        print(f"lesson {lesson.name[:2]}: the unmutated solutions fail their checks ({first}); skipped", flush=True)
        return report
    timeout = min(args.timeout, max(60.0, 5 * seconds))
    print(f"lesson {lesson.name[:2]}: baseline passes in {seconds:.0f} s; {len(planned)} mutants, "
          f"at most {timeout:.0f} s each", flush=True)
    results = [None] * len(planned)  # in the planned order, whatever order they finish in
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_check, solutions, lesson, cell, m.source, timeout): k
                   for k, (exercise, cell, m) in enumerate(planned)}
        for future in tqdm(as_completed(futures), total=len(futures), desc=f"lesson {lesson.name[:2]}", unit="mutant"):
            k = futures[future]
            exercise, cell, m = planned[k]
            passed, seconds, first = future.result()
            results[k] = {"lesson": lesson.name[:2], "exercise": exercise, "cell": cell + 1, "kind": m.kind,
                          "diff": m.diff, "killed": not passed, "first_failure": first, "seconds": round(seconds, 1)}
    report["mutants"] = results
    return report


# ------------------------------------------------------------------ the report

def rate(killed: int, total: int) -> str:
    return f"{100 * killed / total:.0f}%" if total else "-"


def print_report(reports: list[dict]) -> None:
    print(f"\n{'lesson':<7} {'exercise':<9} {'mutants':>7} {'killed':>6} {'survived':>8} {'kill rate':>9}")
    total = killed = 0
    for report in reports:
        if not report.get("baseline", {}).get("passed"):
            print(f"{report['lesson']:<7} (baseline fails: {report.get('baseline', {}).get('first_failure', '')})")
            continue
        by_exercise: dict[str, list[dict]] = {}
        for m in report["mutants"]:
            by_exercise.setdefault(m["exercise"], []).append(m)
        for exercise, ms in by_exercise.items():
            k = sum(m["killed"] for m in ms)
            print(f"{report['lesson']:<7} {exercise:<9} {len(ms):>7} {k:>6} {len(ms) - k:>8} {rate(k, len(ms)):>9}")
            total, killed = total + len(ms), killed + k
    print(f"{'overall':<17} {total:>7} {killed:>6} {total - killed:>8} {rate(killed, total):>9}")
    survivors = [m for report in reports for m in report["mutants"] if not m["killed"]]
    if survivors:
        print(f"\n{len(survivors)} surviving mutant(s): each is a gap in the checks, or equivalent to the solution")
    for m in survivors:
        print(f"\n--- lesson {m['lesson']}, exercise {m['exercise']}, {m['kind']} (cell {m['cell']})\n{m['diff']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Mutation testing of the lessons' exercise checks.")
    parser.add_argument("lessons", nargs="*", metavar="NN", help="lesson numbers (default: all)")
    parser.add_argument("--solutions-dir", type=Path, default=ROOT / "solutions", help="default: solutions/")
    parser.add_argument("--max-per-exercise", type=int, default=12, help="mutants per region (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant at most (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants checked at once (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="which mutants are picked (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write every result to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="print the mutants; run nothing")
    parser.add_argument("--exercise", help="only the regions of this exercise (2.5: 2.5a and 2.5b)")
    args = parser.parse_args(argv)

    notebooks = sorted(args.solutions_dir.glob("[0-9][0-9]_*.ipynb"))
    wanted = [w.zfill(2) for w in args.lessons]
    chosen = [p for p in notebooks if not wanted or p.name[:2] in wanted]
    missing = set(wanted) - {p.name[:2] for p in chosen}
    if missing or not chosen:
        print(f"mutate: no solution notebook for lesson(s) {', '.join(sorted(missing)) or 'any'}", file=sys.stderr)
        return 2
    start = time.monotonic()
    reports = [mutate_lesson(args.solutions_dir, path, args) for path in chosen]
    if args.dry_run:
        return 0
    print_report(reports)
    print(f"\n({time.monotonic() - start:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0 if all(r["baseline"]["passed"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

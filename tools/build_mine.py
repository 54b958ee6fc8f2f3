#!/usr/bin/env python3
"""`make mine`: your own engine, built from your code in lessons/.

    python tools/build_mine.py                                  lessons/ -> build/mine/nanoserve/
    python tools/build_mine.py --lessons-dir DIR --out OUT      DIR -> OUT/nanoserve/

It writes a complete copy of the package, also named `nanoserve`, in its own folder. Each module that
tools/export.py generates from a notebook is assembled the same way (tools/export.py's own functions) from
your lesson notebook's `#| export` cells -- when none of that module's code still holds an exercise stub
(`raise NotImplementedError("Exercise N.M: ...")`) and it compiles; otherwise the reference module from
nanoserve/ goes in, and the table says why. Hand-written modules (cli, zoo, offline_models, checks, bench, the
`__init__`s) and the assets are always the reference's.

The modules import each other as `nanoserve.*`, so the build is switched in by path, not by name:

    PYTHONPATH=build/mine .venv/bin/nanoserve generate "What is the capital of France?" --chat \\
        --model smollm2-135m-instruct

(with `python -c` or `python -m` from the repository root, also set PYTHONSAFEPATH=1: otherwise the current
folder, which holds the reference nanoserve/, comes first on sys.path). `nanoserve.__file__` says which one
you got. The table is also written to OUT/MINE.txt.
"""
import argparse
import re
import shutil
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import MARK, PKG, ExportError, _exports, _read, _write, module_path, module_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("# BUILT by `make mine` (tools/build_mine.py) from your {src} -- rebuilt on every `make mine`.\n"
          "# Edit the lesson notebook, not this file.\n")
STUB = re.compile(r"""^\s*raise\s+NotImplementedError\(\s*["'](Exercise\s+\d+\.\d+\w*)""", re.M)
REPORT = "MINE.txt"  # in OUT: the table, and the mark that OUT/nanoserve is ours to replace
# How to run the build, as the README shows it: SmolLM2-135M-Instruct's real weights, which answer it
RUN = '.venv/bin/nanoserve generate "What is the capital of France?" --chat --model smollm2-135m-instruct'


def reference_modules(ref_pkg: Path) -> dict[str, str]:
    """{dotted module: notebook file name} for every generated module of the reference package."""
    found = {}
    for path in sorted(ref_pkg.rglob("*.py")):
        first = _read(path).split("\n", 1)[0]
        if first.startswith(MARK):
            notebook = first[len(MARK):].split()[0]  # "03_paged_attention.ipynb"
            name = ".".join(path.relative_to(ref_pkg).with_suffix("").parts)
            found[name] = notebook
    return found


def learner_exports(path: Path):
    """({module: [chunk, ...]}, None) from a lesson notebook, or (None, why it cannot be read)."""
    if not path.exists():
        return None, f"no {path.name} in {path.parent}"
    try:
        nb = nbformat.reads(_read(path), as_version=4)
        return _exports(nb, path.name), None
    except ExportError as e:
        return None, f"{e}"
    except Exception as e:  # not JSON, not a notebook
        return None, f"{path.name} does not parse: {type(e).__name__}"


def unsolved(chunks) -> str:
    """'exercise 3.1a, exercise 3.2 not done' for the stubs left in a module's code; '' when there are none."""
    stubs = sorted({" ".join(m.split()).replace("Exercise", "exercise") for c in chunks for m in STUB.findall(c)})
    return f"{', '.join(stubs)} not done" if stubs else ""


def body(text: str) -> str:
    """A module's code without its two header lines (export's and ours both have two)."""
    return text.split("\n", 2)[2]


def yours(name: str, notebook: str, chunks):
    """(module text, None) when the learner's code for a module can go in, else (None, why not)."""
    why = unsolved(chunks)
    if why:
        return None, why
    text = module_text(f"lessons/{notebook}", chunks, header=HEADER)
    try:
        compile(text, str(module_path(name)), "exec")
    except SyntaxError as e:
        return None, f"your code does not compile: line {e.lineno - 3}: {e.msg}"
    return text, None


def build(lessons_dir: Path, out: Path, ref_pkg: Path = ROOT / PKG) -> list[tuple[str, str]]:
    """Write out/nanoserve; [(module, where it came from), ...] in module order."""
    lessons_dir, out = Path(lessons_dir), Path(out)
    target = out / PKG
    if target.exists():
        if not (out / REPORT).exists():
            raise SystemExit(f"build_mine: {target} exists and was not written by make mine; move it away")
        shutil.rmtree(target)
    shutil.copytree(ref_pkg, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    exports = {}  # notebook file name -> (modules, why not)
    rows = []
    for name, notebook in reference_modules(ref_pkg).items():
        if notebook not in exports:
            exports[notebook] = learner_exports(lessons_dir / notebook)
        modules, why_not = exports[notebook]
        lesson = f"lesson {notebook[:2]}"
        chunks = None if modules is None else modules.get(name)
        if modules is not None and chunks is None:
            why_not = f"{notebook} exports no code for it"
        text, why = (None, why_not) if chunks is None else yours(name, notebook, chunks)
        if text is None:
            rows.append((name, f"reference ({lesson}: {why})"))
            continue
        path = out / module_path(name)
        same = body(text) == body(_read(path))  # path: still the reference's copy
        _write(path, text)
        rows.append((name, f"yours ({lesson}{', same code as the reference' if same else ''})"))
    for notebook, (modules, _) in sorted(exports.items()):
        for name in sorted(set(modules or ()) - {r[0] for r in rows}):
            rows.append((name, f"ignored ({notebook} exports it; the engine has no such module)"))

    width = max(len(name) for name, _ in rows)
    count = sum(source.startswith("yours") for _, source in rows)
    lines = [f"{'module':<{width}}  from"] + [f"{name:<{width}}  {source}" for name, source in rows]
    lines.append(f"make mine: {count} of {len(reference_modules(ref_pkg))} generated modules are yours; "
                 "the rest of the package is the reference's")
    _write(out / REPORT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build your own nanoserve from the code in lessons/.")
    parser.add_argument("--lessons-dir", type=Path, default=ROOT / "lessons", help="default: lessons/")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "mine", help="default: build/mine")
    args = parser.parse_args(argv)
    build(args.lessons_dir, args.out)
    out = args.out.resolve()
    shown = out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out
    print(f"run it: PYTHONPATH={shown} {RUN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

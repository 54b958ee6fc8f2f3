"""Stamp result files with where they come from: the commit whose code ran, the machine and the date.

    python bench/stamp.py FILE.json ... [--commit C] [--machine M] [--date YYYY-MM-DD]

Defaults: $COMMIT, else this checkout's commit (with "+changes" when the code differs from it), the GPU's
name (or the CPU's, with its core count) and today. A file that already carries a field keeps it unless one is given.
The keys go at the end of the top-level object, so code reading the others sees them as they were.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

FIELDS = ("commit", "machine", "date")


def this_commit() -> str:
    if os.environ.get("COMMIT"):  # a copy of the tree without .git (a lent GPU machine): the caller says
        return os.environ["COMMIT"]

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
        except OSError:  # no git here
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # results are written under bench/results, which a run changes itself: only the code counts
    changed = git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return commit + ("+changes" if changed else "")


def this_machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return f"{count} x {name}" if count > 1 else name
    except ImportError:
        pass
    return f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"


def stamp(path: Path, values: dict) -> None:
    text = path.read_text()
    found = json.loads(text)
    if not isinstance(found, dict):
        raise SystemExit(f"{path}: the top level is not an object, nothing stamped")
    for key in FIELDS:
        if values.get(key) is not None:
            found.pop(key, None)
            found[key] = values[key]
    indent = re.match(r"\{\n( +)\"", text)
    out = json.dumps(found, indent=len(indent.group(1)) if indent else 1)
    path.write_text(out + ("\n" if text.endswith("\n") else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--machine")
    parser.add_argument("--date")
    args = parser.parse_args()
    for path in args.files:
        have = json.loads(path.read_text())
        values = {key: getattr(args, key) for key in FIELDS}
        defaults = {"commit": this_commit, "machine": this_machine, "date": lambda: datetime.date.today().isoformat()}
        for key, make in defaults.items():
            if values[key] is None and key not in have:
                values[key] = make()
        stamp(path, values)


if __name__ == "__main__":
    main()

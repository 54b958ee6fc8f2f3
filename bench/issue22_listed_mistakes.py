"""Issue 22's listed wrong answers, each put into a copy of the solved lessons, then `make check` on that lesson:
every one must fail (and 8.3's other correct spelling, `data:` without a space, must pass).

    python bench/issue22_listed_mistakes.py [--out bench/results/issue22/listed_mistakes.json]
"""
import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (exercise, notebook, the solution's text, the learner's, must the check fail?)
MISTAKES = [
    ("1.1 the weight multiplied before the cast back", "01_naive_forward",
     "return weight * x32.to(x.dtype)", "return (weight * x32).to(x.dtype)", True),
    ("4.3 blocks returned without reversed", "04_prefix_caching",
     "for block in reversed(blocks):", "for block in blocks:", True),
    ("5.2 append instead of appendleft", "05_scheduler",
     "self.waiting.appendleft(seq)", "self.waiting.append(seq)", True),
    ("5.3 an off-by-one in the step's tokens", "05_scheduler",
     "known = seq.token_ids[start:start + n]", "known = seq.token_ids[start:start + n - 1]", True),
    ("7.3 K/V starts counted from the rank's own K/V heads (no replication)", "07_tensor_parallel",
     "first_kv_head(config, group) * D  # its query heads", "group.rank * local.num_kv_heads * D  # its query heads", True),
    ("8.1 the step loop without its metrics (_report)", "08_serving",
     "                self._apply_aborts()\n                self._report()\n",
     "                self._apply_aborts()\n", True),
    ("8.3 data: without a space (the SSE spec allows it)", "08_serving",
     'return f"data: {data if', 'return f"data:{data if', False),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    results, ok = [], True
    for name, lesson, old, new, must_fail in MISTAKES:
        with tempfile.TemporaryDirectory() as tmp:
            for nb in (ROOT / "solutions").glob("*.ipynb"):
                shutil.copy(nb, tmp)
            path = Path(tmp) / f"{lesson}.ipynb"
            cells = json.loads(path.read_text())
            hits = [c for c in cells["cells"] if old in "".join(c["source"])]
            if len(hits) != 1 or "".join(hits[0]["source"]).count(old) != 1:
                raise SystemExit(f"{name}: the solution's text is not in {lesson} exactly once")
            src = "".join(hits[0]["source"]).replace(old, new)
            hits[0]["source"] = src.splitlines(keepends=True)
            path.write_text(json.dumps(cells, indent=1, ensure_ascii=False))
            done = subprocess.run([sys.executable, "tools/check_lessons.py", "--lessons-dir", tmp, lesson[:2]],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
        failed = done.returncode != 0
        row = next((line.strip() for line in done.stdout.splitlines() if "✗" in line), "")
        results.append({"mistake": name, "check_failed": failed, "as_it_should": failed == must_fail, "row": row[:300]})
        ok &= failed == must_fail
        print(f"{'ok ' if failed == must_fail else 'BAD'} {name}: make check {'fails' if failed else 'passes'}"
              + (f"  [{row[:140]}]" if row else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

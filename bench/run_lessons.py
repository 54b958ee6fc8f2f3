"""Run solution notebooks' code cells in order, in one fresh process per notebook, without Jupyter (the GPU
machine has no kernel): what a learner's run-all does, with pictures drawn off screen. Per cell: ok or the
error, seconds, and the start of what it printed.

    python bench/run_lessons.py OUT.json solutions/03_paged_attention.ipynb solutions/06_cuda_graphs.ipynb ...
"""
import json
import os
import subprocess
import sys
import time

CHILD = '''
import contextlib, io, json, linecache, sys, time, traceback
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
plt.show = lambda *a, **k: None
path = sys.argv[1]
cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
namespace, report = {"__name__": "__main__"}, []
for i, cell in enumerate(cells):
    source, out, start = "".join(cell["source"]), io.StringIO(), time.perf_counter()
    name = f"<{path} code cell {i}>"  # kept in linecache, as IPython does: Triton's @jit reads its source
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, name, "exec"), namespace)
        error = None
    except BaseException as e:
        error = "".join(traceback.format_exception_only(type(e), e)).strip()[-600:]
    report.append({"cell": i, "first_line": source.splitlines()[0][:80] if source else "", "ok": error is None,
                   "error": error, "s": round(time.perf_counter() - start, 2), "printed": out.getvalue()[:400]})
    plt.close("all")
    if error is not None:
        break
print(json.dumps(report))
'''


def main(out_path: str, notebooks: list[str]) -> None:
    results = {}
    for path in notebooks:
        start = time.perf_counter()
        path = os.path.abspath(path)  # run where Jupyter would: in the notebook's folder
        done = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, timeout=900,
                              cwd=os.path.dirname(path))
        try:
            cells = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            cells = [{"ok": False, "error": f"no report (exit {done.returncode}): {done.stderr[-1500:]}"}]
        results[path] = {"all_ok": all(c["ok"] for c in cells), "cells_run": len(cells),
                         "seconds": round(time.perf_counter() - start, 1), "cells": cells}
        print(path, "ok" if results[path]["all_ok"] else "FAILED", f"{results[path]['seconds']} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""The stage ladder of `nanoserve bench --ladder` as a picture for the README.

    python bench/plot_ladder.py bench/results/throughput/h200_ladder.json bench/results/throughput/h200_ladder.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nanoserve.checks.lesson06 import workload_roofline  # noqa: E402

bench = json.load(open(sys.argv[1]))
names = list(bench["ladder"])
roof = workload_roofline()
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for ax, key, goal, ceiling in ((ax1, "workload", 25_000, roof["tok_per_s"]),
                               (ax2, "bs1", 1_000, roof["bandwidth"] / roof["weight_bytes_per_step"])):
    values = [bench["ladder"][n][key]["tok_per_s"] for n in names]
    bars = ax.bar(names, values, color="tab:blue" if key == "workload" else "tab:orange")
    ax.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=9)
    ax.axhline(goal, color="tab:green", ls=":", lw=1.5, label=f"goal {goal:,}")
    ax.axhline(ceiling, color="black", ls="--", lw=1, label=f"roofline {ceiling:,.0f}")
    if key == "workload" and "transformers" in bench:
        ax.axhline(bench["transformers"]["tok_per_s"], color="tab:red", lw=1, label="transformers generate")
    ax.set_title("benchmark workload (256 requests)" if key == "workload" else "one request (batch 1)")
    ax.set_ylabel("output tokens / s")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="upper left")
fig.suptitle(f"{bench['device']}, {bench['model']}: lesson 06's switches, one at a time (one run)")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)

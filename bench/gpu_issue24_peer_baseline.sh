#!/usr/bin/env bash
# One H200 call (issue 24's closing measurements, second part): the peer kit (nano-vllm's engine beside ours,
# two rounds, each engine in fresh processes: results under $OUT/peer), then transformers' batched generate on
# the workload (the baseline of h200_bench.json, $OUT/transformers.json).
#   bash bench/gpu_issue24_peer_baseline.sh     (with .whl and .peer carried; .peer is ../shared/peer)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
OUT=$OUT/peer BUDGET_S=380 NANOSERVE_ROOT=$PWD bash .peer/run_side_by_side.sh > $OUT/peer.log 2>&1
tail -14 $OUT/peer.log; echo "peer $(( $(date +%s) - t0 )) s"
timeout 200 python3 - > $OUT/transformers.log 2>&1 <<'PY'
import json, os
from nanoserve.bench import bench_transformers, workload
prompts, max_tokens = workload()
found = bench_transformers("qwen3-0.6b-random", prompts, max_tokens)
print(found)
json.dump(found, open(os.path.join(os.environ["OUT"], "transformers.json"), "w"), indent=1)
PY
tail -2 $OUT/transformers.log; echo "transformers $(( $(date +%s) - t0 )) s"

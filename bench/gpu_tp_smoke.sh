#!/usr/bin/env bash
# one stage with a hard limit; on a hang, every worker dumps its Python stacks (faulthandler on SIGABRT)
stage=$1; limit=$2
PYTHONFAULTHANDLER=1 python bench/gpu_tp_smoke.py $stage $limit &
pid=$!
for i in $(seq 1 $((limit + 5))); do sleep 1; kill -0 $pid 2>/dev/null || break; done
if kill -0 $pid 2>/dev/null; then echo "HANG: dumping workers"; pkill -ABRT -f "multiprocessing.spawn"; sleep 2; kill -9 $pid; fi
pkill -9 -f "multiprocessing.spawn"; wait $pid; echo "stage $stage rc=$?"

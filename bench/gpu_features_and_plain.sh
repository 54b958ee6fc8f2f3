#!/usr/bin/env bash
# H200, one call: bench/gpu_features.sh (GPU checks, then `nanoserve bench --features`), then the plain engine
# against 74158e1's (before the features moved beside the core) in alternating fresh processes, three rounds.
#   bash bench/gpu_features_and_plain.sh     (.whl and .oldtree carried; .oldtree = `git archive 74158e1 nanoserve`)
set -u
t0=$(date +%s)
bash bench/gpu_features.sh
left=$(( 575 - ($(date +%s) - t0) ))
echo "rounds get ${left} s"
timeout $left python3 bench/engine_rounds.py .oldtree $PWD --rounds 3 --out $OUT/rounds.json > $OUT/rounds.log 2>&1
tail -12 $OUT/rounds.log
echo "all $(( $(date +%s) - t0 )) s"

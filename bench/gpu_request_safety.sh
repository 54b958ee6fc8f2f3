#!/usr/bin/env bash
# H200: issue 39's engine changes on the GPU path, then the plain engine against 74158e1's (before the issue) in
# alternating fresh processes.   bash bench/gpu_request_safety.sh   (.whl and .oldtree carried:
# .oldtree holds `git archive 74158e1 nanoserve`)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_request_safety.py $OUT/request_safety.json > $OUT/request_safety.log 2>&1; tail -12 $OUT/request_safety.log
echo "safety $(( $(date +%s) - t0 )) s"
python3 bench/gpu_logits_processors.py $OUT/logits_processors.json > $OUT/logits_processors.log 2>&1; tail -4 $OUT/logits_processors.log
echo "processors $(( $(date +%s) - t0 )) s"
python3 bench/engine_rounds.py .oldtree $PWD --rounds 2 --out $OUT/rounds.json > $OUT/rounds.log 2>&1; tail -8 $OUT/rounds.log
echo "rounds $(( $(date +%s) - t0 )) s"

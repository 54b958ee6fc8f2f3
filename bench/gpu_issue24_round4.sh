#!/usr/bin/env bash
# One H200 call (issue 24, after cos/sin are read in place by the q/k-norm + RoPE kernel): the kernels' tests in
# bf16, build/old_tree (main at the session's start) against this tree (3 alternating rounds, fresh processes),
# then lesson 06 cell by cell. Each part writes under $OUT as it ends.
#   bash bench/gpu_issue24_round4.sh      (with build/old_tree, bench/wheels, build/wheels_test)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl build/wheels_test/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k "qk_norm or pick or split_counters or gemv" > $OUT/kernel_tests.txt 2>&1; tail -1 $OUT/kernel_tests.txt
echo "tests $(( $(date +%s) - t0 )) s"
python3 bench/engine_rounds.py build/old_tree . --rounds 3 --out $OUT/rounds.json > $OUT/rounds.log 2>&1; tail -12 $OUT/rounds.log
echo "rounds $(( $(date +%s) - t0 )) s"
python3 bench/run_lessons.py $OUT/lesson06.json solutions/06_cuda_graphs.ipynb > $OUT/lesson06.log 2>&1; tail -2 $OUT/lesson06.log
echo "lesson 06 $(( $(date +%s) - t0 )) s"

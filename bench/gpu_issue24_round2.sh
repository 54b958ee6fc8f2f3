#!/usr/bin/env bash
# One H200 call (issue 24, this session's kernels): the kernels' tests in bf16, the fp32 invariance run,
# build/old_tree (main at the session's start) against this tree in fresh processes (3 alternating rounds),
# and the time split per step. Each part writes under $OUT as it ends, so a call cut short keeps what it finished.
#   bash bench/gpu_issue24_round2.sh      (with build/old_tree, bench/wheels and build/wheels_test carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl build/wheels_test/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k "gemv or qk_norm or decode or pick" > $OUT/kernel_tests.txt 2>&1; tail -1 $OUT/kernel_tests.txt
echo "tests $(( $(date +%s) - t0 )) s"
python3 bench/gpu_engine_invariance.py > $OUT/invariance_fp32.txt 2>&1; tail -2 $OUT/invariance_fp32.txt
echo "invariance $(( $(date +%s) - t0 )) s"
python3 bench/engine_rounds.py build/old_tree . --rounds 3 --out $OUT/rounds.json > $OUT/rounds.log 2>&1; tail -12 $OUT/rounds.log
echo "rounds $(( $(date +%s) - t0 )) s"
python3 bench/gpu_time_split.py $OUT/time_split.json --skip-workload-profile > $OUT/time_split.log 2>&1; tail -1 $OUT/time_split.log
echo "split $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# One H200 call (issue 24, after round 2's fix of the pick kernel's recompiles): the sampler kernel's tests in
# bf16, build/old_tree (main at the session's start) against this tree in fresh processes (3 alternating
# rounds), the time split per step with the workload's GPU profile, and one batch-1 replay's kernels.
#   bash bench/gpu_issue24_round3.sh      (with build/old_tree, bench/wheels and build/wheels_test carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl build/wheels_test/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k "pick or split_counters" > $OUT/kernel_tests.txt 2>&1; tail -1 $OUT/kernel_tests.txt
echo "tests $(( $(date +%s) - t0 )) s"
python3 bench/engine_rounds.py build/old_tree . --rounds 3 --out $OUT/rounds.json > $OUT/rounds.log 2>&1; tail -12 $OUT/rounds.log
echo "rounds $(( $(date +%s) - t0 )) s"
python3 bench/gpu_step_floor.py $OUT/step_floor.json --skip-matmuls > $OUT/step_floor.log 2>&1; tail -2 $OUT/step_floor.log | cut -c1-400
echo "floor $(( $(date +%s) - t0 )) s"
python3 bench/gpu_time_split.py $OUT/time_split.json > $OUT/time_split.log 2>&1; tail -1 $OUT/time_split.log
echo "split $(( $(date +%s) - t0 )) s"

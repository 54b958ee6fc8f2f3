#!/usr/bin/env bash
# One H200 call (issue 22's lessons, issue 24's kernels): the new kernels' tests in bf16, lesson 07 cell by cell,
# build/old_tree (main before the kernels) against this tree in fresh processes, lesson 06 and lesson 03 cell
# by cell. Each part writes under $OUT as it ends, so a call cut short keeps what it finished.
#   bash bench/gpu_issue24_check.sh      (with build/old_tree, bench/wheels and build/wheels_test carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl build/wheels_test/*.whl build/wheels_nb/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k "gemv or qk_norm or decode_random" > $OUT/kernel_tests.txt 2>&1; tail -1 $OUT/kernel_tests.txt
echo "tests $(( $(date +%s) - t0 )) s"
python3 bench/run_lessons.py $OUT/lesson07.json solutions/07_tensor_parallel.ipynb > $OUT/lesson07.log 2>&1; tail -2 $OUT/lesson07.log
echo "lesson 07 $(( $(date +%s) - t0 )) s"
PYTHONPATH=/tmp/site python3 bench/engine_rounds.py build/old_tree . --rounds 1 --out $OUT/rounds.json > $OUT/rounds.log 2>&1; tail -4 $OUT/rounds.log
echo "rounds $(( $(date +%s) - t0 )) s"
python3 bench/run_lessons.py $OUT/lesson06.json solutions/06_cuda_graphs.ipynb > $OUT/lesson06.log 2>&1; tail -2 $OUT/lesson06.log
echo "lesson 06 $(( $(date +%s) - t0 )) s"
python3 bench/run_lessons.py $OUT/lesson03.json solutions/03_paged_attention.ipynb > $OUT/lesson03.log 2>&1; tail -2 $OUT/lesson03.log
echo "lesson 03 $(( $(date +%s) - t0 )) s"

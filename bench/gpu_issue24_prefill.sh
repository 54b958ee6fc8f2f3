#!/usr/bin/env bash
# One H200 call (issue 24, the prefill kernel with the causal mask only across the diagonal and a kv head's
# query heads in one program): the attention kernels' tests in bf16, bench/attention_kernels.py (lesson 03's
# stored results), then build/old_tree (main at the session's start) against this tree, 2 alternating rounds in
# fresh processes. Each part writes under $OUT as it ends.
#   bash bench/gpu_issue24_prefill.sh      (with build/old_tree and .whl carried: pytest and its wheels)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py > $OUT/kernel_tests.txt 2>&1
tail -1 $OUT/kernel_tests.txt; echo "tests $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/attention_kernels.py --out $OUT/h200_attention.json > $OUT/attention.log 2>&1
grep -E "prefill|vs" $OUT/attention.log | tail -8; echo "attention $(( $(date +%s) - t0 )) s"
python3 bench/engine_rounds.py build/old_tree . --rounds 2 --out $OUT/rounds.json > $OUT/rounds.log 2>&1
tail -8 $OUT/rounds.log; echo "rounds $(( $(date +%s) - t0 )) s"

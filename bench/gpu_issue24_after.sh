#!/usr/bin/env bash
# One short H200 call after the closing runs: the engine as LLM(model) builds it with this session's later
# changes (the metadata builder's input ids joined in C, the loader's meta build without random init), start-up
# from LLM(...) to the first token (empty, then warm compile caches), lesson 05's engine tests on the GPU.
#   bash bench/gpu_issue24_after.sh      (with .whl carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_startup.py $OUT/startup.json --runs 2 > $OUT/startup.log 2>&1; tail -2 $OUT/startup.log
echo "startup $(( $(date +%s) - t0 )) s"
python3 -m nanoserve.cli bench --no-baseline --out $OUT/default_auto.json > $OUT/default_auto.log 2>&1
grep "tok/s" $OUT/default_auto.log | tail -1; echo "bench $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_lesson05.py -x > $OUT/lesson05_tests.txt 2>&1
tail -1 $OUT/lesson05_tests.txt; echo "tests $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# One H200 call (issue 24's closing measurements), each part in fresh processes, writing under $OUT as it ends:
#   start-up from LLM(...) to the first token (empty, then warm compile caches: bench/gpu_startup.py),
#   the stage ladder with the step profile (-> bench/results/h200_bench.json), the engine as LLM(model) builds
#   it with kv_cache_dtype auto and fp8 (-> h200_bench_default.json and the fp8 row), lesson 02's sampler tests.
#   bash bench/gpu_issue24_final.sh      (with .whl carried: pytest, hypothesis, llguidance wheels)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_startup.py $OUT/startup.json --runs 3 > $OUT/startup.log 2>&1; tail -3 $OUT/startup.log
echo "startup $(( $(date +%s) - t0 )) s"
python3 -m nanoserve.cli bench --ladder --profile --no-baseline --out $OUT/h200_bench.json > $OUT/ladder.log 2>&1
grep -E "tok/s|ms" $OUT/ladder.log | tail -12; echo "ladder $(( $(date +%s) - t0 )) s"
for dtype in fp8 auto; do
  python3 -m nanoserve.cli bench --no-baseline --kv-cache-dtype $dtype --out $OUT/default_$dtype.json > $OUT/default_$dtype.log 2>&1
  grep "tok/s" $OUT/default_$dtype.log | tail -1; echo "$dtype $(( $(date +%s) - t0 )) s"
done
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_sampler.py > $OUT/sampler_tests.txt 2>&1
tail -1 $OUT/sampler_tests.txt; echo "tests $(( $(date +%s) - t0 )) s"

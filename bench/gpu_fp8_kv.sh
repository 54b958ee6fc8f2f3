#!/usr/bin/env bash
# One H200 call (issue 24, the fp8 KV cache): the Triton kernels' fp8 and store tests in bf16, the decode and
# prefill kernels over bf16 against fp8 caches (bench/gpu_fp8_decode.py), then `nanoserve bench` with
# kv_cache_dtype auto and fp8, alternating (auto, fp8, fp8, auto), each a fresh process. Each part writes
# under $OUT as it ends (the logs in $OUT/logs.tgz).
#   bash bench/gpu_fp8_kv.sh     (with .whl carried: llguidance, gguf, pytest, pluggy, iniconfig, hypothesis,
#                                 sortedcontainers wheels for Python 3.12, installed into the image's Python)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
L=/tmp/fp8_logs; mkdir -p $L
python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py tests/test_kv_cache_dtype.py \
  -k "fp8 or store_kv or kv_cache_dtype" > $L/kernel_tests_fp8.txt 2>&1; tail -1 $L/kernel_tests_fp8.txt
echo "tests $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/gpu_fp8_decode.py $OUT/fp8_kernels.json 2>&1 | tee $L/fp8_kernels.log | grep -E "^(decode|prefill)"
echo "kernels $(( $(date +%s) - t0 )) s"
for run in auto_1 fp8_1 fp8_2 auto_2; do
  kv=${run%_*}
  timeout 150 python3 -m nanoserve.cli bench --no-baseline --kv-cache-dtype $kv --out $OUT/bench_$run.json > $L/bench_$run.log 2>&1
  echo "$run rc $? $(grep -E '^nanoserve:' $L/bench_$run.log | tail -1)"
done
tar -czf $OUT/logs.tgz -C $L .
echo "total $(( $(date +%s) - t0 )) s"

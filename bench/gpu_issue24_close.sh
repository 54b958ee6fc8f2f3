#!/usr/bin/env bash
# One H200 call (issue 24's last checks, on the tree as it stands): start-up from LLM(...) to the first token
# with empty and then warm caches, plus one warm run under cProfile with torch.compile's recompile log; every
# fast path against the eager engine in float32 (bench/gpu_fast_paths_fp32.py); bf16 parity with transformers.
#   bash bench/gpu_issue24_close.sh      (with .whl carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_startup.py $OUT/startup.json --runs 2 --profile $OUT/startup_profile.txt > $OUT/startup.log 2>&1
tail -2 $OUT/startup.log; echo "startup $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/gpu_fast_paths_fp32.py $OUT/fast_paths_fp32.json > $OUT/fast_paths_fp32.log 2>&1
tail -2 $OUT/fast_paths_fp32.log; echo "fast paths $(( $(date +%s) - t0 )) s"
timeout 150 python3 bench/gpu_bf16_parity.py --out $OUT/bf16_parity.json > $OUT/bf16_parity.log 2>&1
tail -4 $OUT/bf16_parity.log; echo "parity $(( $(date +%s) - t0 )) s"

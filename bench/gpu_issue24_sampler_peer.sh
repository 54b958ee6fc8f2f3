#!/usr/bin/env bash
# One H200 call (issue 24): lesson 02's sampler after its hash moved to int32 (wrapping products) checked on the
# GPU (tests/test_sampler.py; the Triton pick kernel against torch's pick on CUDA), then the peer kit
# (nano-vllm's engine beside ours, two rounds; results under $OUT/peer).
#   bash bench/gpu_issue24_sampler_peer.sh     (with .whl and .peer carried; .peer is ../shared/peer)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_sampler.py > $OUT/sampler_tests.txt 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k triton_pick \
  >> $OUT/sampler_tests.txt 2>&1
grep -E "passed|failed" $OUT/sampler_tests.txt; echo "tests $(( $(date +%s) - t0 )) s"
OUT=$OUT/peer NANOSERVE_ROOT=$PWD timeout 330 bash .peer/run_side_by_side.sh > /tmp/peer.log 2>&1
tail -14 /tmp/peer.log; echo "peer $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# H200: the features beside the core. The GPU checks of the logits processors and structured outputs
# (fp32 token equality alone / batched / eager, constraints in bf16), then `nanoserve bench --features`.
#   bash bench/gpu_features.sh        (.whl carried: the wheels the GPU image lacks, llguidance among them)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_issue23.py $OUT/logits_processors.json > $OUT/logits_processors.log 2>&1; tail -6 $OUT/logits_processors.log
echo "processors $(( $(date +%s) - t0 )) s"
python3 bench/gpu_request_safety.py $OUT/request_safety.json > $OUT/request_safety.log 2>&1; tail -8 $OUT/request_safety.log
echo "safety $(( $(date +%s) - t0 )) s"
python3 -m nanoserve.cli bench --features --out $OUT/features.json > $OUT/features.log 2> $OUT/features.err; cat $OUT/features.log; tail -3 $OUT/features.err
echo "features $(( $(date +%s) - t0 )) s"

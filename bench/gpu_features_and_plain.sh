#!/usr/bin/env bash
# H200 (or H100), one call, within CAP seconds (default 400): `nanoserve bench --features`, the logits
# processors' GPU checks (bench/gpu_logits_processors.py: fp32 token equality alone / batched / eager, constraints in
# bf16), then the plain engine against 74158e1's (before the features moved beside the core) in alternating
# fresh processes, up to three rounds, in the time left.
#   CAP=570 bash bench/gpu_features_and_plain.sh   (.whl and .oldtree carried; .oldtree = `git archive 74158e1 nanoserve`,
#   the engine before the features moved beside the core)
set -u
t0=$(date +%s)
cap=${CAP:-400}
left() { echo $(( cap - ($(date +%s) - t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
timeout $(left) python3 -m nanoserve.cli bench --features --out $OUT/features.json > $OUT/features.log 2> $OUT/features.err
cat $OUT/features.log; tail -3 $OUT/features.err
echo "features $(( $(date +%s) - t0 )) s"
timeout $(( $(left) / 2 )) python3 bench/gpu_logits_processors.py $OUT/logits_processors.json > $OUT/logits_processors.log 2>&1
tail -6 $OUT/logits_processors.log
echo "processors $(( $(date +%s) - t0 )) s; rounds get $(left) s"
timeout $(left) python3 bench/engine_rounds.py .oldtree $PWD --rounds 3 --out $OUT/rounds.json > $OUT/rounds.log 2>&1
tail -12 $OUT/rounds.log
echo "all $(( $(date +%s) - t0 )) s"

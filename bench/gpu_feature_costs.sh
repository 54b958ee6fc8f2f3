#!/usr/bin/env bash
# GPU, one call (~250 s on an H100): the feature kernels' tests (bf16 included), bench/gpu_logits_processors.py (fp32 token
# equality of every fast path, the constraints in bf16), then `nanoserve bench --features` (two rounds). Results in $OUT.
set -u
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_triton_attention.py -k "logsumexp or bitmask or pick" 2>&1 | tail -3
echo "kernels $(( $(date +%s) - t0 )) s"
timeout 110 python3 bench/gpu_logits_processors.py $OUT/logits_processors.json > $OUT/logits_processors.log 2>&1; tail -4 $OUT/logits_processors.log
python3 -c "import json;d=json.load(open('$OUT/logits_processors.json'));print({k:(all(v) if isinstance(v,list) and v and isinstance(v[0],bool) else v) for k,v in d.items() if 'bf16_lengths' not in k and 'min_tokens' not in k})"
echo "processors $(( $(date +%s) - t0 )) s"
timeout 330 python3 -m nanoserve.cli bench --features --out $OUT/features.json > $OUT/features.log 2> $OUT/features.err
cat $OUT/features.log; tail -2 $OUT/features.err
echo "all $(( $(date +%s) - t0 )) s"

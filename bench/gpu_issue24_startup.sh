#!/usr/bin/env bash
# One H200 call (issue 24's start-up goal, after the compiled ops stopped compiling again for one row):
# does this machine keep Python's bytecode caches; start-up from LLM(...) to the first token with empty and
# then warm caches, first as the machine is, then with Python's bytecode cached under PYTHONPYCACHEPREFIX
# (as any pip install leaves it: pip writes .pyc files when it installs); the warm import tree
# (python -X importtime); the workload and batch 1; every fast path against the eager engine in float32.
#   bash bench/gpu_issue24_startup.sh      (with .whl carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > /dev/null 2>&1
t0=$(date +%s)
TORCH_DIR=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
{ python3 -c "import os, sys; print('dont_write_bytecode', sys.dont_write_bytecode, 'pycache_prefix', sys.pycache_prefix, 'PYTHONDONTWRITEBYTECODE', os.environ.get('PYTHONDONTWRITEBYTECODE'))"
  echo "torch dir $TORCH_DIR writable: $( [ -w $TORCH_DIR ] && echo yes || echo no )"
  echo "torch .pyc files: $(find $TORCH_DIR -name '*.pyc' | wc -l), .py files: $(find $TORCH_DIR -name '*.py' | wc -l)"
} > $OUT/bytecode.txt 2>&1; cat $OUT/bytecode.txt
python3 bench/gpu_startup.py $OUT/startup_as_is.json --runs 2 > $OUT/startup_as_is.log 2>&1
tail -2 $OUT/startup_as_is.log; echo "startup as is $(( $(date +%s) - t0 )) s"
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -c "import nanoserve, transformers, torch._dynamo, triton" > /dev/null 2>&1  # not timed: caches the bytecode of what these import, as pip's install would have
python3 bench/gpu_startup.py $OUT/startup_pycache.json --runs 3 > $OUT/startup_pycache.log 2>&1
tail -3 $OUT/startup_pycache.log; echo "startup pycache $(( $(date +%s) - t0 )) s"
python3 -X importtime -c "from nanoserve import LLM, SamplingParams; llm = LLM('qwen3-0.6b-random'); llm.generate(['x'], SamplingParams(max_tokens=1), use_tqdm=False)" 2> $OUT/importtime_warm.txt > /dev/null
sort -t'|' -k2 -n $OUT/importtime_warm.txt | tail -4; echo "importtime $(( $(date +%s) - t0 )) s"
python3 -m nanoserve.cli bench --no-baseline --out $OUT/default_auto.json > $OUT/default_auto.log 2>&1
grep "tok/s" $OUT/default_auto.log | tail -2; echo "bench $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/gpu_fast_paths_fp32.py $OUT/fast_paths_fp32.json > $OUT/fast_paths_fp32.log 2>&1
tail -2 $OUT/fast_paths_fp32.log; echo "fast paths $(( $(date +%s) - t0 )) s"

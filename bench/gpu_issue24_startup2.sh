#!/usr/bin/env bash
# One H200 call (issue 24's start-up goal, after the tokenizer stopped going through AutoTokenizer): start-up
# from LLM(...) to the first token, empty then warm torch.compile/Triton caches, (a) as the machine is
# (PYTHONDONTWRITEBYTECODE=1: no Python bytecode is ever cached) and (b) with bytecode cached as a pip
# install leaves it (a first, untimed start fills PYTHONPYCACHEPREFIX); the named tokenizer class against
# AutoTokenizer on transformers 5.17; the workload and batch 1.
#   bash bench/gpu_issue24_startup2.sh      (with .whl carried)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 smollm2-135m-instruct > /dev/null 2>&1
t0=$(date +%s)
python3 bench/gpu_startup.py $OUT/startup_as_is.json --runs 2 > $OUT/startup_as_is.log 2>&1
tail -2 $OUT/startup_as_is.log; echo "startup as is $(( $(date +%s) - t0 )) s"
( unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache
  python3 bench/gpu_startup.py $OUT/startup_fill_bytecode.json --runs 1 > $OUT/startup_fill_bytecode.log 2>&1
  python3 bench/gpu_startup.py $OUT/startup_bytecode.json --runs 2 > $OUT/startup_bytecode.log 2>&1 )
tail -2 $OUT/startup_bytecode.log; echo "startup with bytecode $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_loader.py -k "named or does_not_have or rejects" > $OUT/tokenizer_tests.txt 2>&1
tail -1 $OUT/tokenizer_tests.txt; echo "tests $(( $(date +%s) - t0 )) s"
python3 -m nanoserve.cli bench --no-baseline --out $OUT/default_auto.json > $OUT/default_auto.log 2>&1
grep "tok/s" $OUT/default_auto.log | tail -1; echo "bench $(( $(date +%s) - t0 )) s"

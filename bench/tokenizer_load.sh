#!/usr/bin/env bash
# H200 machine: how long loading the tokenizer takes in a fresh process, through load_tokenizer (the named
# class) and through AutoTokenizer, as the machine is (no bytecode caches) and with bytecode cached; and
# whether LLM(...) still imports AutoTokenizer's module (transformers.models.auto.auto_factory).
#   bash bench/tokenizer_load.sh     (prints; PYTHONPATH is this tree)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}  # where the import tree is written
python3 -m nanoserve.cli prepare qwen3-0.6b-random > /dev/null 2>&1
OURS="import time; t = time.perf_counter(); from nanoserve.model.loader import load_tokenizer; from nanoserve.model.zoo import resolve_model; load_tokenizer(resolve_model('qwen3-0.6b-random')); print(f'load_tokenizer {time.perf_counter() - t:.2f} s')"
AUTO="import time; t = time.perf_counter(); from transformers import AutoTokenizer; from nanoserve.model.zoo import resolve_model; AutoTokenizer.from_pretrained(resolve_model('qwen3-0.6b-random')); print(f'AutoTokenizer {time.perf_counter() - t:.2f} s')"
for mode in as_is bytecode; do
  if [ $mode = bytecode ]; then unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache; python3 -c "$OURS; $AUTO" > /dev/null; fi
  for i in 1 2; do echo "$mode $(python3 -c "$OURS") | $(python3 -c "$AUTO")"; done
done
python3 -X importtime -c "from nanoserve import LLM, SamplingParams; llm = LLM('qwen3-0.6b-random'); llm.generate(['x'], SamplingParams(max_tokens=1), use_tqdm=False)" 2> $OUT/importtime_llm.txt > /dev/null
echo "LLM(...) imports auto_factory: $(grep -c 'transformers.models.auto.auto_factory' $OUT/importtime_llm.txt), sklearn: $(grep -c '| *sklearn$' $OUT/importtime_llm.txt)"

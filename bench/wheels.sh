#!/usr/bin/env bash
# Wheels for a GPU machine without the network (Python 3.12, manylinux x86_64; its image has torch, Triton,
# transformers, numpy): what the engine's features need (llguidance, gguf), what `nanoserve serve` needs
# (fastapi, starlette, uvicorn, pydantic), what `transformers serve` imports besides (openai), and the tests'
# own (pytest, hypothesis). bench/run_gpu.sh installs them there with --no-deps, so nothing else is pulled in.
#
#   bash bench/wheels.sh            -> .whl/*.whl (git-ignored; carry it to the GPU machine with the tree)
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
# The versions the CPU tests ran with; openai 1.x for transformers' serving types (its 5.x code asks >= 1.98).
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$tmp" \
    "fastapi==0.165.0" "starlette==1.10.0" "uvicorn==0.54.0" "pydantic==2.14.4" "pydantic-core==2.50.5" \
    "openai>=1.99,<2" "llguidance==1.6.1" "gguf==0.19.0" pytest hypothesis nbformat
# Already in the GPU image, and heavy or risky to shadow: keep its own.
rm -f "$tmp"/numpy-* "$tmp"/tqdm-* "$tmp"/torch-* "$tmp"/triton-* "$tmp"/nvidia_* "$tmp"/typing_extensions-*
# only now replace the old set: a download that failed halfway leaves it as it was
rm -rf .whl && mv "$tmp" .whl
ls .whl
du -sh .whl

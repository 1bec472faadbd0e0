#!/usr/bin/env bash
# One-shot GPU check (parity + timing), for a machine with a CUDA GPU and only its
# image's PyTorch/transformers: runs from the source tree, installs nothing.
# Parity eager and with CUDA graphs, then acb eager / graphs, async on / off, against
# transformers' generate_batch, with GPU idle ms per step; timing rows past
# ACB_GPU_CHECK_BUDGET_S (400) are skipped so the run ends within the 480 s below.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 python3 benchmarks/gpu_check.py "$@"

#!/usr/bin/env bash
# One-shot GPU check (kernel parity, greedy parity, timing table), for a machine with a
# CUDA GPU and only its image's PyTorch/Triton/transformers: runs from the source tree,
# installs nothing, needs no network. Output goes to docs/logs/gpu_check-<date>.log (and
# $OUT when set); the table also to docs/performance.md. Timing rows past
# ACB_GPU_CHECK_BUDGET_S (400) are skipped so the run ends within ACB_GPU_CHECK_TIMEOUT_S (470).
# On a machine without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
LOG="docs/logs/gpu_check-$(date -u +%Y-%m-%d-%H%M).log"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  exec python3 benchmarks/gpu_check.py "$@"  # prints that there is no CUDA device; exits 0
fi
mkdir -p docs/logs
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  timeout "${ACB_GPU_CHECK_TIMEOUT_S:-470}" python3 benchmarks/gpu_check.py "$@"; } 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
[ -n "${OUT:-}" ] && cp "$LOG" "$OUT/" 2>/dev/null
exit "$rc"

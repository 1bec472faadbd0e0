#!/usr/bin/env bash
# Set up, then run the test suite (CPU only; the GPU checks live in benchmarks/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python-env.sh
echo "test: python -m pytest -q ${WORKERS[*]} $* with $PY"
exec "$PY" -m pytest -q "${WORKERS[@]}" "$@"

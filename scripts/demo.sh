#!/usr/bin/env bash
# Set up, then stream answers to several chat prompts concurrently from SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python-env.sh
echo "demo: streaming 6 chat answers at once from SmolLM2-135M-Instruct with $PY"
exec "$PY" examples/stream_chat.py "$@"

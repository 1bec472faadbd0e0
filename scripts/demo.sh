#!/usr/bin/env bash
# Set up, then stream answers to several chat prompts concurrently from SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/stream_chat.py "$@"

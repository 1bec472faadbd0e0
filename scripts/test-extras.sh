#!/usr/bin/env bash
# CI's second step: the slow extras (tests marked `extras`: multi-process, Ray, real browsers, ...).
# The default suite (scripts/test.sh) deselects them to stay fast; CI always runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --extras
source scripts/python-env.sh
echo "test-extras: python -m pytest -q -m extras ${WORKERS[*]} $* with $PY"
set +e
"$PY" -m pytest -q -m extras "${WORKERS[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when no test carries the marker: nothing to run is not a failure here.
if [ "$rc" -eq 5 ]; then echo "test-extras: no extras tests selected"; exit 0; fi
exit "$rc"

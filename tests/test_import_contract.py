"""The dependency rules of docs/design.md, checked on the source: the scheduler and the
cache manager are plain Python (no torch, no runner); the runner and attention code never
reach up into the engine or the integrations; nothing but tests imports acb.testing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ACB = Path(__file__).resolve().parent.parent / "acb"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = "." * node.level + (node.module or "")
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" if node.module else prefix + alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["scheduler.py", "kv_cache.py"])
def test_scheduling_core_is_plain_python(module):
    names = imported_modules(ACB / module)
    assert not any(n == "torch" or n.startswith("torch.") for n in names), names
    assert not any("runner" in n or "engine" in n or "attention" in n for n in names), names


@pytest.mark.parametrize("module", ["runner.py", "attention.py", "sampling.py", "kernels/cpu.py", "cuda_graphs.py",
                                    "compiling.py", "offload.py", "kernels/cpu_linear.py", "distributed/group.py",
                                    "distributed/protocol.py", "distributed/sharding.py", "distributed/worker.py",
                                    "kernels/triton_attention.py"])
def test_device_side_never_imports_the_engine_or_integrations(module):
    names = imported_modules(ACB / module)
    assert not any("engine" in n or "integrations" in n or "server" in n for n in names), names


def test_library_code_does_not_import_acb_testing():
    offenders = []
    for path in ACB.rglob("*.py"):
        if "testing" in path.parts or path.name in ("cli.py", "server.py"):
            continue  # acb serve --tiny is a test aid; it imports acb.testing lazily
        if any("testing" in n for n in imported_modules(path)):
            offenders.append(str(path))
    assert offenders == []

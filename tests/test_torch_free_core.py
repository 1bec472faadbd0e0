"""The request-side core (every module of acb/core/) imports and works without torch: the
scheduler, the KV allocator and its events, the step types, requests, configs, errors and the
lifecycle (issue 22).
Checked here in a subprocess whose imports of torch fail, and by CI's `core` stage, which
runs this file with the scheduler's and allocator's tests in a new environment without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# every module of the core layer's folder, so a new one is checked the day it lands
CORE = sorted("acb.core." + p.stem for p in (ROOT / "acb" / "core").glob("*.py") if p.stem != "__init__")

PROGRAM = textwrap.dedent("""
    import importlib, importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")

    sys.meta_path.insert(0, NoTorch())
    import acb
    for name in CORE:
        importlib.import_module(name)
    from acb.core.kv_cache import KVCacheManager
    from acb.core.scheduler import FINISHED, Scheduler, Sequence
    from acb.core.step import StepOutput

    # two requests through the scheduler to their ends, as the engine drives it
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_batch_tokens=32, max_requests=4)
    seqs = [Sequence(f"r{i}", [1, 2, 3, 4, 5], 3, arrival=i) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, StepOutput([7] * plan.num_sampled, None))
    assert all(s.status is FINISHED and s.output_ids == [7, 7, 7] for s in seqs)
    assert kv.num_free == kv.num_pages
    assert acb.SamplingParams(max_new_tokens=4).max_new_tokens == 4 and acb.EngineConfig(page_size=8).page_size == 8
    assert "torch" not in sys.modules, "a core module imported torch"
    print("ok")
""")


def test_the_core_imports_and_schedules_without_torch():
    code = f"CORE = {CORE!r}\n" + PROGRAM
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_engine_still_names_torch_when_it_is_missing():
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("No module named 'torch'")
        sys.meta_path.insert(0, NoTorch())
        import acb
        acb.Engine
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr

"""benchmarks/gpu_check.sh where torch has no CUDA: it says so, checks nothing, exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu_check.sh would run for minutes")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    # gpu_check.sh runs `python3`: here, this test's own (the environment it was installed into)
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no CUDA device" in run.stdout and "nothing checked" in run.stdout
    assert "PARITY" not in run.stdout and "KERNEL" not in run.stdout

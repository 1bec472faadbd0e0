"""gpu_check's tensor-parallel row: greedy parity of tensor_parallel_size=2 (NCCL, one
GPU per rank) with one rank and with transformers' generate, on acb's tiny models.

    python benchmarks/gpu_check_tp.py       # alone; benchmarks/gpu_check.py calls tp_parity()

It needs two CUDA devices (NCCL puts each rank on its own GPU); on a machine with one
it prints that it was skipped and why, and passes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import acb  # noqa: E402
from acb.testing import random_prompts, reference_greedy, tiny_model  # noqa: E402


def tp_parity(archs: tuple[str, ...] = ("llama", "qwen2", "mistral")) -> bool:
    """Print one PARITY row per architecture; False if any differs or fails."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"PARITY tp=2 SKIPPED: needs 2 CUDA devices, this machine has {gpus}", flush=True)
        return True
    ok_all = True
    prompts = random_prompts(9, 3, 40, seed=5)
    for arch in archs:
        started = time.perf_counter()
        try:
            model = tiny_model(arch, device="cuda:0")
            expected = [reference_greedy(model, p, 16) for p in prompts]
            got = {}
            for size in (1, 2):
                cfg = acb.EngineConfig(page_size=4, num_blocks=32, max_batch_tokens=24, safety_margin=0.0,
                                       tensor_parallel_size=size, device="cuda:0", dtype="float32")

                async def run(cfg=cfg, model=model):
                    async with acb.Engine(model, config=cfg) as engine:
                        res = await engine.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)
                        return [r.token_ids for r in res], engine.stats().preemptions

                got[size] = asyncio.run(run())
            bad = sum(t != e for t, e in zip(got[2][0], expected, strict=True))
            ok = bad == 0 and got[2][0] == got[1][0]
            print(f"PARITY tp=2 {arch:8s} {'ok' if ok else 'FAIL'} ({bad} of {len(prompts)} differ from generate, "
                  f"tp=1 {'equal' if got[2][0] == got[1][0] else 'DIFFERS'}, preemptions={got[2][1]}, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
            ok_all &= ok
        except Exception:
            traceback.print_exc()
            print(f"PARITY tp=2 {arch} ERROR", flush=True)
            ok_all = False
    return ok_all


if __name__ == "__main__":
    sys.exit(0 if tp_parity() else 1)

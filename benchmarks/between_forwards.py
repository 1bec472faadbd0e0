"""What a step costs besides its forward: the host work around it, on the step thread and the loop's.

    python benchmarks/between_forwards.py                        # int8 weights, int8 pages, real text
    python benchmarks/between_forwards.py --variant fp32 --workload standard
    PYTHONPATH=. python benchmarks/between_forwards.py           # from a worktree: its acb

Runs SmolLM2 through an Engine on 48 prompts of a workload (after a warm-up pass, as bench.py
does; 96 new tokens each) with a timer around each of the engine's own calls, and prints, per
step on average: on the step thread, the model's forward and what ``ModelRunner.execute`` does
besides it (block tables, page zeroing, building the step's tensors, sampling); on the event
loop's thread, planning the next step (``StepLoop._launch``, ``_check_model`` within it) and
delivering the last one (``Outputs.deliver``); and the gaps between one step's end on the step
thread and the next one's start, when nothing computes (the loop plans step N+1 while step N
runs, so a gap is the step thread waiting to be scheduled, not for a plan). The loop thread's
work overlaps the forward and takes its CPU time from it on a 2-core host. Timers cost ~1 us a
call; compare parts, not the wall time, with bench.py's.
"""
# ruff: noqa: E402
from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import workloads

import acb
from acb import fused, kv_store, outputs, quantization, runner, step_loop
from acb.loading import load, smollm2

T: dict[str, float] = collections.defaultdict(float)
STEPS: list[tuple[float, float]] = []  # (start, end) of each ModelRunner.execute


def timed(cls, name: str, tag: str | None = None) -> None:
    fn = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[tag or name] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def instrument() -> None:
    execute = runner.ModelRunner.execute

    def timed_execute(self, step):
        t0 = time.perf_counter()
        try:
            return execute(self, step)
        finally:
            STEPS.append((t0, time.perf_counter()))

    runner.ModelRunner.execute = timed_execute
    timed(runner.ModelRunner, "forward", "runner.forward")
    timed(runner.ModelRunner, "_build", "build the step's tensors")
    timed(runner, "sample", "sample")
    for name in ("update_tables", "zero_new_pages", "move_pages"):
        timed(kv_store.KVStore, name, f"kv.{name}")
    for cls in (quantization.Int8Forward, fused.FusedForward):
        timed(cls, "__call__", "model forward")
    timed(step_loop.StepLoop, "_launch", "plan the next step (_launch)")
    timed(step_loop.StepLoop, "_check_model", "  of which _check_model")
    timed(outputs.Outputs, "deliver", "deliver (Outputs.deliver)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="int8_kv8", choices=["fp32", "bf16", "int8", "int8_kv8"],
                   help="fp32, bf16, int8 weights with bf16 between (int8), and int8 pages too (int8_kv8)")
    p.add_argument("--workload", default="realtext", choices=["standard", "realtext"])
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--new", type=int, default=96)
    args = p.parse_args()
    dtype = "float32" if args.variant == "fp32" else "bfloat16"
    quant = "int8" if args.variant.startswith("int8") else None
    w = workloads.build(args.workload, None, args.prompts, 2.0)
    model, tok = load(*smollm2(), dtype=dtype, quantization=quant)
    model = model if quant else model.to(getattr(torch, dtype))
    instrument()

    async def run() -> float:
        config = acb.EngineConfig(dtype=dtype, quantization=quant,
                                  kv_cache_dtype="int8" if args.variant == "int8_kv8" else None)
        async with acb.Engine(model, tokenizer=tok, config=config) as engine:
            await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)
            engine.kv.evict_all_cached()
            T.clear()
            STEPS.clear()
            t0 = time.perf_counter()
            await engine.generate_batch(w.prompts, max_new_tokens=args.new, ignore_eos=True)
            return time.perf_counter() - t0

    wall = asyncio.run(run())
    n = len(STEPS)
    gaps = sorted(STEPS[i + 1][0] - STEPS[i][1] for i in range(n - 1))
    busy = sum(e - s for s, e in STEPS)
    print(f"{args.variant}, {args.workload}: {n} steps, wall {wall:.2f} s, "
          f"{args.prompts * args.new / wall:.1f} tok/s")
    print(f"step thread: executing {busy:.2f} s, of which the model's forward {T['model forward']:.2f} s")
    print("per step, ms:")
    rows = [("model forward", T["model forward"]),
            ("execute besides the forward", busy - T["model forward"]),
            ("  runner.forward besides the model", T["runner.forward"] - T["model forward"]),
            *((f"    {k}", T[k]) for k in ("kv.update_tables", "kv.move_pages", "kv.zero_new_pages",
                                          "build the step's tensors")),
            ("  sample", T["sample"]),
            ("gaps between steps (nothing computes)", sum(gaps)),
            ("loop thread: plan the next step (_launch)", T["plan the next step (_launch)"]),
            ("  of which _check_model", T["  of which _check_model"]),
            ("loop thread: deliver (Outputs.deliver)", T["deliver (Outputs.deliver)"])]
    for name, seconds in rows:
        print(f"  {name:<44} {1e3 * seconds / n:8.3f}")
    print(f"gap median {1e3 * gaps[len(gaps) // 2]:.2f} ms, max {1e3 * gaps[-1]:.2f} ms")


if __name__ == "__main__":
    main()

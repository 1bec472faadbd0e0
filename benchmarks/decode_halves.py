"""Decode steps whole or as two halves (the DecodeLoops' ``split_rows``), alternated in one engine:

    python benchmarks/decode_halves.py                       # int8, real-text prompts, 4 pairs
    python benchmarks/decode_halves.py --variant bf16 --workload standard --pairs 6

On two threads a DecodeLoop runs a decode step of ``split_rows`` rows or more as two halves, one per
thread (acb/kernels/csrc/decode_loop.h). This loads SmolLM2 once (int8 with bf16 pages, or bf16), warms the
engine up, then times the workload's whole batch (prefill and decode, cold prefix cache each time) with
``split_rows`` 0 (never) and 16 (the default) in turn, the order swapped every pair, so both see the same
machine; prints each run's seconds and each setting's median and best. Prefill steps are the same either
way: the difference is the decode steps'.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import workloads  # noqa: E402

import acb  # noqa: E402
from acb.loading import load, smollm2  # noqa: E402
from acb.testing.inspection import runner_of  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="int8", choices=("int8", "bf16"))
    p.add_argument("--workload", default="realtext")
    p.add_argument("--pairs", type=int, default=4)
    args = p.parse_args()
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    w = workloads.build(args.workload)
    quant = "int8" if args.variant == "int8" else None
    model, tok = load(*smollm2(), dtype="bfloat16", quantization=quant)

    async def run() -> dict[int, list[float]]:
        engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(dtype="bfloat16", quantization=quant))
        async with engine:
            await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)
            loop = runner_of(engine).fast_paths.fused.loop
            if loop is None:
                sys.exit("no DecodeLoop here (acb's native kernels are not built, or the model is not one it takes)")
            times: dict[int, list[float]] = {0: [], 16: []}
            for pair in range(args.pairs):
                for split in (0, 16) if pair % 2 == 0 else (16, 0):
                    loop.split_rows = split
                    engine.kv.evict_all_cached()
                    t0 = time.perf_counter()
                    await engine.generate_batch(w.prompts, max_new_tokens=w.max_new_tokens, ignore_eos=True)
                    times[split].append(time.perf_counter() - t0)
            return times

    times = asyncio.run(run())
    for split, t in times.items():
        print(f"{args.variant} {args.workload} split_rows {split:2d}: " + " ".join(f"{x:.2f}" for x in t)
              + f" s; median {statistics.median(t):.2f}, best {min(t):.2f}")


if __name__ == "__main__":
    main()

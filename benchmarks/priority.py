"""Interactive requests' time to first token behind a flood of batch work, fifo against
priority, same run (the two schedulers one after the other on the same model and workload).

    python benchmarks/priority.py                       # SmolLM2-135M-Instruct on CPU
    python benchmarks/priority.py --tiny                # acb.testing's tiny random model (seconds)
    python benchmarks/priority.py --batch 64 --interactive 8 --rate 1 --max-requests 16

The batch requests (priority 10, ``--batch-prompt`` prompt tokens, ``--batch-new`` new
tokens each) are all submitted at t=0; interactive ones (priority 0, short prompts, 8 new
tokens) arrive every 1/``--rate`` seconds from t=0.5 s. ``--max-requests`` bounds the rows
of a step (``max_requests_per_batch``), so that the batch work fills the batch and a queue
forms, which is what priority reorders: with rows and pages to spare both schedulers admit
an arrival in the next step. Prints each scheduler's interactive TTFT p50/p99 (from
``Completion.metrics``), when all the work was done, the engine steps it took (the
load-independent count: wall times on a shared machine vary with its load) and the
preemptions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

import acb  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(make_engine, scheduler: str, args: argparse.Namespace) -> dict:
    config = acb.EngineConfig(scheduler=scheduler, max_requests_per_batch=args.max_requests,
                              max_waiting_requests=4 * (args.batch + args.interactive))
    engine = make_engine(config)
    levels = (lambda p: {"priority": p}) if scheduler == "priority" else (lambda p: {})
    async with engine:
        await engine.generate([1, 2, 3], max_new_tokens=2)  # warm-up: kernels, first-step costs
        start = time.monotonic()
        batch = [engine.submit([5 + (i * 7 + j) % 90 for j in range(args.batch_prompt)], max_new_tokens=args.batch_new,
                               ignore_eos=True, **levels(10)) for i in range(args.batch)]

        async def interactive(i: int) -> acb.Completion:
            await asyncio.sleep(0.5 + i / args.rate)
            return await engine.generate([10 + i, 20, 30, 40, 50, 60, 70, 80], max_new_tokens=8, ignore_eos=True,
                                         **levels(0))

        done = await asyncio.gather(*(interactive(i) for i in range(args.interactive)), *batch)
        elapsed = time.monotonic() - start
        ttft = [c.metrics.ttft_s for c in done[: args.interactive]]
        stats = engine.stats()
    return {"scheduler": scheduler, "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
            "ttft_s": ttft, "all_done_s": elapsed, "preemptions": stats.preemptions, "steps": stats.steps,
            "generated_tokens": stats.generated_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batch-prompt", type=int, default=64)
    p.add_argument("--batch-new", type=int, default=64)
    p.add_argument("--interactive", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="interactive arrivals per second")
    p.add_argument("--max-requests", type=int, default=16, help="max_requests_per_batch")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.tiny:
        from acb.testing import tiny_engine

        def make_engine(config):
            return tiny_engine(config=acb.EngineConfig(**{**config.__dict__, "num_blocks": 1024, "page_size": 16}))
    else:
        from acb.model.loading import smollm2

        folder, gguf = smollm2()

        def make_engine(config):
            return acb.Engine.from_pretrained(folder, gguf_file=gguf, config=config)

    results = [asyncio.run(run(make_engine, scheduler, args)) for scheduler in ("fifo", "priority")]
    print(f"{args.batch} batch requests ({args.batch_prompt} prompt + {args.batch_new} new tokens, priority 10) + "
          f"{args.interactive} interactive at {args.rate}/s (priority 0), max_requests_per_batch={args.max_requests}")
    print(f"{'scheduler':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'all done':>9} {'steps':>6} {'preempt':>8}")
    for r in results:
        print(f"{r['scheduler']:<10} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s {r['all_done_s']:>8.1f}s "
              f"{r['steps']:>6} {r['preemptions']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

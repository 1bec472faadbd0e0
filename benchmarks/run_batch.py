"""``acb run-batch``'s runner against ``Engine.generate_batch`` on the same prompts, one engine, alternated.

    python benchmarks/run_batch.py                    # 500 lines: SmolLM2, the standard prompts cycled, 32 new tokens
    python benchmarks/run_batch.py --lines 200 --new 16 --rounds 3

Each line is a ``/v1/completions`` request whose prompt is a token-id list from the standard workload
(greedy, EOS ignored), so both sides run exactly the same tokens; the batch side pays what a batch file
costs on top (JSON parsing, the OpenAI request checks and response shaping, one flushed line per result).
Prints each round's wall time and tokens/s and the median ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=500)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import workloads

    import acb
    from acb.integrations.batch_files import run_batch_file
    from acb.integrations.openai_service import OpenAIService
    from acb.loading import smollm2

    prompts = workloads.standard().prompts
    prompts = [prompts[i % len(prompts)] for i in range(args.lines)]
    folder, gguf_file = smollm2()

    async def run() -> list[tuple[float, float]]:
        rounds = []
        async with acb.Engine.from_pretrained(folder, gguf_file=gguf_file) as engine:
            service = OpenAIService(engine, model_name="m")
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp, "in.jsonl")
                path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                                    "body": {"model": "m", "prompt": ids, "max_tokens": args.new,
                                                             "temperature": 0, "ignore_eos": True}}) + "\n"
                                        for i, ids in enumerate(prompts)))
                await engine.generate_batch(prompts[:8], max_new_tokens=2, ignore_eos=True)  # warm-up
                for r in range(args.rounds):
                    engine.kv.evict_all_cached()
                    t = time.perf_counter()
                    await engine.generate_batch(prompts, max_new_tokens=args.new, ignore_eos=True, do_sample=False)
                    direct = time.perf_counter() - t
                    engine.kv.evict_all_cached()
                    out = Path(tmp, f"out{r}.jsonl")
                    t = time.perf_counter()
                    summary = await run_batch_file(service, path, out)
                    batch = time.perf_counter() - t
                    assert summary.succeeded == args.lines, summary
                    tokens = args.lines * args.new
                    print(f"round {r + 1}: generate_batch {direct:.1f} s ({tokens / direct:.1f} tok/s), "
                          f"run_batch_file {batch:.1f} s ({tokens / batch:.1f} tok/s): {direct / batch:.3f}x",
                          flush=True)
                    rounds.append((direct, batch))
        return rounds

    rounds = asyncio.run(run())
    ratio = statistics.median(d / b for d, b in rounds)
    print(f"load {os.getloadavg()[0]:.2f}; median run-batch / generate_batch throughput: {ratio:.3f}x "
          f"({args.lines} lines, {args.new} new tokens each)")


if __name__ == "__main__":
    main()

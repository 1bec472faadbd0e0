"""SmolLM2 with tensor_parallel_size=2 against one rank, in the same run (CPU).

    python benchmarks/tensor_parallel.py                 # 16 prompts x 64 new tokens, 2 rounds
    python benchmarks/tensor_parallel.py --prompts 32 --new 32 --rounds 3

Each round runs the same requests on a one-rank engine, then on a two-rank engine
(alternating, so a machine shared with other work slows both alike), and reports
generated tokens per second, ms per step and time to first token. Both use the same
cores: one rank with all of them, or two ranks with half each. Results in
docs/distributed.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


async def main(args) -> None:
    import torch
    from scaling import run as measure
    from systems import load_smollm2

    import acb

    model, tok = load_smollm2()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.prompts)]
    threads = torch.get_num_threads()
    results: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        # a fresh engine per round and size: a two-rank engine gives each rank half the
        # threads while it is open (torch.set_num_threads is per process)
        for size in (1, 2):
            started = time.perf_counter()
            config = acb.EngineConfig(num_blocks=args.blocks, tensor_parallel_size=size)
            async with acb.Engine(model, tokenizer=tok, config=config) as engine:
                up = time.perf_counter() - started
                await measure(engine, prompts[:2], 4)  # warm-up (kernels, prepacking)
                results[size].append(await measure(engine, prompts, args.new))
            print(f"tp={size} (up in {up:.1f} s): {results[size][-1]}", flush=True)
    print(f"\nSmolLM2-135M, {args.prompts} prompts of 32-256 tokens x {args.new} new tokens, "
          f"{args.rounds} rounds, same run")
    print("| ranks | threads per rank | tok/s (median) | ms/step | TTFT p50 s |")
    print("|---|---|---|---|---|")
    for size in (1, 2):
        rows = results[size]
        print(f"| {size} | {max(1, threads // size)} | {statistics.median(r['tok_per_s'] for r in rows):.1f} | "
              f"{statistics.median(r['ms_per_step'] for r in rows):.1f} | "
              f"{statistics.median(r['ttft_p50_s'] for r in rows):.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=1024, help="KV pages per rank")
    asyncio.run(main(parser.parse_args()))

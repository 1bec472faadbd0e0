"""SmolLM2 with tensor parallelism against one rank, in the same run (CPU).

    python benchmarks/tensor_parallel.py                      # SmolLM2: 1 rank (all threads, 1 thread) vs 3
    python benchmarks/tensor_parallel.py --heads 12 --kv-heads 4 --sizes 1,2

SmolLM2-135M has 9 attention heads and 3 KV heads, so it splits 3 ways, not 2
(tensor_parallel_size=2 is refused). ``--heads``/``--kv-heads`` measure instead a model
of SmolLM2's size (hidden 576, MLP 1536, 30 layers, its vocabulary) with random weights
and that many heads, e.g. 12 and 4 for two ranks.

Each round runs the same requests on each size in turn (so a machine shared with other
work slows them alike), with a fresh engine each time, and reports generated tokens per
second, ms per step and time to first token. All sizes share the same cores: one rank
uses all of them, N ranks 1/N each. Results in docs/distributed.md.
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


def load(args):
    from systems import load_model

    model, tok = load_model()
    if args.heads is None:
        return model, tok, "SmolLM2-135M"
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.num_attention_heads, config.num_key_value_heads = args.heads, args.kv_heads
    config.head_dim = config.hidden_size // args.heads
    return (AutoModelForCausalLM.from_config(config).eval(), tok,
            f"SmolLM2-sized random model, {args.heads} heads / {args.kv_heads} KV heads")


async def main(args) -> None:
    import torch
    from scaling import run as measure

    import acb

    model, tok, name = load(args)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.prompts)]
    threads = torch.get_num_threads()
    # "N" runs N ranks over all the threads; "NxT" runs N ranks over T threads in all
    runs = [tuple(int(v) for v in (s.split("x") if "x" in s else (s, threads))) for s in args.sizes.split(",")]
    results: dict[tuple[int, int], list[dict]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        # a fresh engine per round and size: a tensor-parallel engine gives each rank its
        # share of the threads while it is open (torch.set_num_threads is per process)
        for size, total in runs:
            torch.set_num_threads(total)
            started = time.perf_counter()
            config = acb.EngineConfig(num_blocks=args.blocks, tensor_parallel_size=size)
            async with acb.Engine(model, tokenizer=tok, config=config) as engine:
                up = time.perf_counter() - started
                await measure(engine, prompts[:2], 4)  # warm-up (kernels, prepacking)
                results[size, total].append(await measure(engine, prompts, args.new))
            torch.set_num_threads(threads)
            print(f"tp={size} threads={total} (up in {up:.1f} s): {results[size, total][-1]}", flush=True)
    print(f"\n{name}, {args.prompts} prompts of 32-256 tokens x {args.new} new tokens, "
          f"{args.rounds} rounds, same run")
    print("| ranks | threads per rank | tok/s (median) | ms/step | TTFT p50 s |")
    print("|---|---|---|---|---|")
    for size, total in runs:
        rows = results[size, total]
        print(f"| {size} | {max(1, total // size)} | {statistics.median(r['tok_per_s'] for r in rows):.1f} | "
              f"{statistics.median(r['ms_per_step'] for r in rows):.1f} | "
              f"{statistics.median(r['ttft_p50_s'] for r in rows):.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1,1x1,3", help="tensor_parallel_size values, comma-separated; NxT: "
                        "N ranks over T threads in all (default: every thread)")
    parser.add_argument("--heads", type=int, help="random weights with this many attention heads")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=1024, help="KV pages per rank")
    asyncio.run(main(parser.parse_args()))

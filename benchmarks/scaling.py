"""How acb's throughput and step time scale with concurrency and prompt length (SmolLM2).

    python benchmarks/scaling.py                      # both tables
    python benchmarks/scaling.py --concurrency 1,4,16 --lengths 64,512

Prompts are random token ids (seeded); each request generates --new tokens, EOS ignored.
Writes the tables as JSON (default bench-results/scaling.json) and plots them
(bench-results/img/throughput_vs_concurrency.png, see plots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plots  # noqa: E402


async def run(engine, prompts: list[list[int]], new: int, label: str = "warm-up") -> dict:
    from acb.core.progress import BatchProgress

    bar = BatchProgress(len(prompts), desc=label)
    s0 = engine.stats()
    t0 = time.perf_counter()
    ttft: list[float] = []

    async def one(p):
        start = time.perf_counter()
        n = 0
        async for chunk in engine.stream(p, max_new_tokens=new, ignore_eos=True):
            if n == 0:
                ttft.append(time.perf_counter() - start)
            n += len(chunk.token_ids)
        bar.add(n)
        return n

    with bar:
        generated = sum(await asyncio.gather(*(one(p) for p in prompts)))
    dt = time.perf_counter() - t0
    steps = engine.stats().steps - s0.steps
    return {"tok_per_s": generated / dt, "ms_per_step": 1e3 * dt / steps, "steps": steps,
            "ttft_p50_s": sorted(ttft)[len(ttft) // 2]}


async def main(args) -> None:
    from systems import load_model

    import acb

    model, tok = load_model()
    rng = random.Random(0)
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(max_requests_per_batch=512))

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(3, 49000) for _ in range(length)] for _ in range(n)]

    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "command": " ".join(["python", *sys.argv]),
            "concurrency": {"prompt_len": args.prompt_len, "new_tokens": args.new, "rows": []},
            "lengths": {"requests": args.len_requests, "new_tokens": args.new, "rows": []}}
    async with engine:
        await run(engine, prompts(4, 64), 4)  # warm-up
        print(f"concurrency sweep: prompts of {args.prompt_len} tokens, {args.new} new tokens each")
        print(f"{'requests':>9}{'tok/s':>9}{'ms/step':>9}{'steps':>7}{'TTFT p50 s':>12}")
        for n in map(int, args.concurrency.split(",")):
            r = await run(engine, prompts(n, args.prompt_len), args.new, f"{n} requests")
            data["concurrency"]["rows"].append({"requests": n, **r})
            print(f"{n:>9}{r['tok_per_s']:>9.1f}{r['ms_per_step']:>9.0f}{r['steps']:>7}{r['ttft_p50_s']:>12.2f}",
                  flush=True)
        print(f"\nprompt-length sweep: {args.len_requests} requests, {args.new} new tokens each")
        print(f"{'length':>9}{'tok/s':>9}{'ms/step':>9}{'steps':>7}{'TTFT p50 s':>12}")
        for length in map(int, args.lengths.split(",")):
            r = await run(engine, prompts(args.len_requests, length), args.new, f"length {length}")
            data["lengths"]["rows"].append({"length": length, **r})
            print(f"{length:>9}{r['tok_per_s']:>9.1f}{r['ms_per_step']:>9.0f}{r['steps']:>7}"
                  f"{r['ttft_p50_s']:>12.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}\nwrote {plots.plot_scaling(data, args.out.parent / 'img')}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16,64,256")
    p.add_argument("--lengths", default="64,256,512,1024,2048")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--len-requests", type=int, default=8)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench-results/scaling.json"))
    asyncio.run(main(p.parse_args()))

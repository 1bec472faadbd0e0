"""1 vs N Ray Serve replicas of SmolLM2 behind one OpenAI endpoint, measured back to back
in one run (so a shared machine's load hits every configuration alike).

    python benchmarks/ray_replicas.py                       # 1 and 2 replicas, 2 CPUs
    python benchmarks/ray_replicas.py --replicas 1,2,4 --cpus 8 --requests 64

Each configuration gets the same CPUs in total (--cpus split evenly over its replicas),
one warm-up request per replica, then --requests concurrent /v1/completions requests
(random token prompts of --prompt tokens, --new tokens each, EOS ignored) through
Ray Serve's HTTP proxy. Prints and writes (default bench-results/ray_replicas.json)
requests/s, generated tokens/s and latency percentiles per configuration.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import time
from pathlib import Path

import aiohttp
import ray
from ray import serve

import acb
from acb.integrations.ray import REPLICA_HEADER, build_app
from acb.model.loading import smollm2


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], new: int) -> tuple[float, str, int]:
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return time.perf_counter() - start, resp.headers[REPLICA_HEADER], answer["usage"]["completion_tokens"]


async def _load(url: str, prompts: list[list[int]], new: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(_one(session, url, p, 4) for p in prompts[:4]))  # warm-up
        start = time.perf_counter()
        done = await asyncio.gather(*(_one(session, url, p, new) for p in prompts))
        wall = time.perf_counter() - start
    latencies = sorted(d[0] for d in done)
    return {
        "wall_s": round(wall, 2), "requests_per_s": round(len(done) / wall, 3),
        "generated_tokens_per_s": round(sum(d[2] for d in done) / wall, 1),
        "latency_p50_s": round(statistics.median(latencies), 2),
        "latency_p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 2),
        "requests_per_replica": sorted(
            [sum(1 for d in done if d[1] == r) for r in {d[1] for d in done}], reverse=True),
    }


async def _in_process(folder: str, gguf_file: str, prompts: list[list[int]], new: int) -> dict:
    """The same load on one engine in this process, no HTTP, no Ray: what Ray adds."""
    async with acb.Engine.from_pretrained(folder, gguf_file=gguf_file, config=acb.EngineConfig(device="cpu")) as eng:
        await asyncio.gather(*(eng.generate(p, max_new_tokens=4) for p in prompts[:4]))  # warm-up
        start = time.perf_counter()
        done = await asyncio.gather(*(eng.generate(p, max_new_tokens=new, temperature=0.0, ignore_eos=True)
                                      for p in prompts))
        wall = time.perf_counter() - start
    return {"replicas": "in-process engine, no Ray", "wall_s": round(wall, 2),
            "requests_per_s": round(len(done) / wall, 3),
            "generated_tokens_per_s": round(sum(len(c.token_ids) for c in done) / wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2", help="replica counts to compare (default: 1,2)")
    p.add_argument("--cpus", type=float, default=float(os.cpu_count() or 2), help="CPUs in total per configuration")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="generated tokens per request")
    p.add_argument("--baseline", action="store_true", help="first run the load on one in-process engine")
    p.add_argument("--out", default="bench-results/ray_replicas.json")
    args = p.parse_args()
    folder, gguf_file = smollm2()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt)] for _ in range(args.requests)]
    results = []
    if args.baseline:
        results.append(asyncio.run(_in_process(folder, gguf_file, prompts, args.new)))
        print(json.dumps(results[-1]), flush=True)
    ray.init(num_cpus=max(1, int(args.cpus)), include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        for n in (int(x) for x in args.replicas.split(",")):
            app = build_app(folder, gguf_file=gguf_file, num_replicas=n, engine_config=acb.EngineConfig(device="cpu"),
                            ray_actor_options={"num_cpus": args.cpus / n})
            serve.run(app, name="bench", route_prefix="/")
            row = {"replicas": n, "cpus_per_replica": args.cpus / n, **asyncio.run(_load(url, prompts, args.new))}
            print(json.dumps(row), flush=True)
            results.append(row)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "ray": ray.__version__, "args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()

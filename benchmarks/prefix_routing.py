"""Prefix-aware routing against the free-pages router: 2 Ray Serve replicas of SmolLM2, a
shared-prefix workload, both routers in one run (one after the other, each on fresh
replicas with cold caches), so a shared machine's load hits both alike.

    python benchmarks/prefix_routing.py                   # 8 documents x 6 questions, 2 replicas
    python benchmarks/prefix_routing.py --docs 8 --questions 6 --doc 384 --concurrency 8 --rounds 2

The workload: --docs documents (random tokens, --doc long: a system prompt or a document
each) and --questions questions per document (--question tokens appended to it), sent
interleaved (question 1 of every document, then question 2 of every document, ...) by
--concurrency clients, each sending its next request when its last one is answered; --new
tokens each, EOS ignored. Each replica gets one CPU and one torch thread and --num-blocks
KV pages (default: 6 documents' worth plus the running requests' own, so that neither
replica can hold every document). --rounds 2 runs the routers as free-pages, prefix,
prefix, free-pages.

Per router: the prefix-cache hit rate (prompt tokens served from the cache over all prompt
tokens, from each answer's ``metrics``), requests/s and generated tokens/s over the whole
workload, TTFT p50, how many replicas computed each document, and requests per replica.
Writes --out (default bench-results/prefix_routing.json).
"""

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import ray
from ray import serve

import acb
from acb.integrations.ray import REPLICA_HEADER, FreePagesRouter, PrefixAwareRouter, build_app
from acb.model.loading import smollm2

ROUTERS = {"free-pages": FreePagesRouter, "prefix": PrefixAwareRouter}


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], new: int) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "include_metrics": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    metrics = answer["metrics"]
    return {"replica": resp.headers[REPLICA_HEADER], "prompt": metrics["prompt_tokens"],
            "cached": metrics["cached_prompt_tokens"], "generated": metrics["completion_tokens"],
            "ttft_s": metrics["time_to_first_token_ms"] / 1000}


async def _workload(url: str, requests: list[tuple[int, list[int]]], args: argparse.Namespace,
                    warmup: list[list[int]]) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for prompt in warmup:  # one per replica, unrelated to the documents
            await _one(session, url, prompt, 2)
        queue = list(enumerate(requests))
        done: list[tuple[int, dict]] = []

        async def client() -> None:
            while queue:
                i, (doc, prompt) = queue.pop(0)
                done.append((doc, await _one(session, url, prompt, args.new)))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
    answers = [a for _, a in done]
    homes: dict[int, set[str]] = {}
    for doc, a in done:
        homes.setdefault(doc, set()).add(a["replica"])
    per_replica: dict[str, int] = {}
    for a in answers:
        per_replica[a["replica"]] = per_replica.get(a["replica"], 0) + 1
    return {
        "prefix_hit_rate": round(sum(a["cached"] for a in answers) / sum(a["prompt"] for a in answers), 4),
        "prompt_tokens_computed": sum(a["prompt"] - a["cached"] for a in answers),
        "wall_s": round(wall, 2), "requests_per_s": round(len(answers) / wall, 3),
        "generated_tokens_per_s": round(sum(a["generated"] for a in answers) / wall, 1),
        "ttft_p50_s": round(statistics.median(a["ttft_s"] for a in answers), 3),
        "replicas_per_doc": sorted(len(r) for r in homes.values()),
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=6, help="questions per document")
    p.add_argument("--doc", type=int, default=384, help="document (shared prefix) tokens")
    p.add_argument("--question", type=int, default=16, help="question tokens")
    p.add_argument("--new", type=int, default=16, help="generated tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pages per replica (default: 6 documents' worth plus the running requests' own)")
    p.add_argument("--rounds", type=int, default=1, help="1: free-pages then prefix; 2: and prefix then free-pages")
    p.add_argument("--out", default="bench-results/prefix_routing.json")
    args = p.parse_args()
    folder, gguf_file = smollm2()
    page_size = args.page_size
    if args.num_blocks is None:
        args.num_blocks = 6 * -(-args.doc // page_size) + args.concurrency * -(-(args.question + args.new) // page_size)
    rng = random.Random(0)
    docs = [[rng.randrange(100, 30000) for _ in range(args.doc)] for _ in range(args.docs)]
    requests = [(d, docs[d] + [rng.randrange(100, 30000) for _ in range(args.question)])
                for _ in range(args.questions) for d in range(args.docs)]
    warmup = [[rng.randrange(100, 30000) for _ in range(8)] for _ in range(args.replicas)]
    order = ["free-pages", "prefix"] if args.rounds == 1 else ["free-pages", "prefix", "prefix", "free-pages"]
    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for router in order:
            config = acb.EngineConfig(device="cpu", page_size=page_size, num_blocks=args.num_blocks,
                                      kv_events=router == "prefix")
            app = build_app(folder, gguf_file=gguf_file, num_replicas=args.replicas, engine_config=config,
                            request_router=ROUTERS[router],
                            ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}})
            serve.run(app, name="bench", route_prefix="/")
            load = os.getloadavg()[0]
            row = {"router": router, "load_before": round(load, 2),
                   **asyncio.run(_workload(url, requests, args, warmup)),
                   "load_after": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), flush=True)
            results.append(row)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                               "source": "python benchmarks/prefix_routing.py " + " ".join(sys.argv[1:]),
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "ray": ray.__version__, "page_size": page_size, "args": vars(args),
                               "results": results}, indent=2))


if __name__ == "__main__":
    main()

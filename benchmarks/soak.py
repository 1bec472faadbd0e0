"""Soak benchmark (not a CI test): thousands of requests over minutes on a tiny model.

    python benchmarks/soak.py --minutes 2 --rate 20          # ~3500 requests
    python benchmarks/soak.py --minutes 10 --json soak.json  # longer, numbers to a file

Arrivals are Poisson at ``--rate`` requests/s plus a burst of ``--burst-size`` every
``--burst-every`` seconds. Each request takes one route at random: streamed and read
to the end, awaited with ``generate``, a ``generate_batch`` of four, seeded sampling,
a slow reader, a stream left with ``break``, a task cancelled mid-flight. It reports

- RSS over time (sampled every ``--sample-every`` s) and its drift after warm-up,
- event-loop lag: a ticker sleeps 5 ms and records how late it wakes (p50/p99/max),
- errors (anything but the cancellations the run asked for: must be 0),
- wrong tokens (greedy output that differs from transformers' ``generate``, or a seeded
  request that differs from an earlier one with the same prompt and seed: must be 0),
- pages free at the end (must equal the total) and ``check_integrity()``.

Exit status 1 when an error, a wrong token, a leaked page or a failed integrity check
was seen, so a long run can gate a release.

``--overload`` runs a different soak, against ``acb serve`` in a subprocess (the tiny
model by default, ``--model-dir`` for a real one): it first measures the rate the server
sustains (``--concurrency`` closed-loop clients for ``--calibrate`` s), then sends
open-loop Poisson arrivals at ``--factor`` (10) times that rate for ``--minutes``.
Every request must be answered in full (200 with the whole body) or refused with 429
and ``Retry-After``; one that gets no answer within ``--hang-after`` s counts as a hang.
It reports the status counts, hangs, latency of admitted requests (p50/p99/max), the
server's RSS over time and its drift after warm-up, ``/health`` answers polled every
second, and the server's free pages (``/metrics``) at the end. Exit status 1 on a hang,
an answer other than 200/429, a failed ``/health``, or pages not all free::

    python benchmarks/soak.py --overload --minutes 10 --json overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

sys.path.insert(0, __file__.rsplit("/", 2)[0])

import acb
from acb.testing import random_prompts, reference_greedy, tiny_engine

ROUTES = {  # route: weight
    "stream": 40, "generate": 15, "batch": 5, "seeded": 10, "slow": 5, "break": 15, "task_cancel": 10,
}
MAX_NEW = 32


@dataclass
class Report:
    minutes: float
    rate: float
    requests: int = 0
    by_route: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    wrong_tokens: int = 0
    wrong_samples: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    loop_lag_ms: dict[str, float] = field(default_factory=dict)
    rss_mb: list[tuple[float, float, int]] = field(default_factory=list)  # (seconds, MB, live requests)
    rss_drift_mb: float = 0.0
    peak_live: int = 0
    steps: int = 0
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    total_blocks: int = 0
    free_blocks_at_end: int = 0
    integrity_ok: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.errors == 0 and self.wrong_tokens == 0 and self.integrity_ok
                and self.free_blocks_at_end == self.total_blocks)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.prompts = random_prompts(args.prompts, 3, 48, seed=args.seed)
        self.report = Report(minutes=args.minutes, rate=args.rate)
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.lags: list[float] = []
        self.seeded: dict[tuple[int, int], list[int]] = {}
        self.refs: list[list[int]] = []
        self.engine: acb.Engine | None = None

    # ------------------------------------------------------------------ bookkeeping
    def error(self, route: str, e: BaseException) -> None:
        self.report.errors += 1
        if len(self.report.error_samples) < 10:
            self.report.error_samples.append(f"{route}: {e!r}")

    def check_greedy(self, route: str, i: int, tokens: list[int], full: int | None) -> None:
        want = self.refs[i][: len(tokens) if full is None else full]
        if tokens != want:
            self.report.wrong_tokens += 1
            if len(self.report.wrong_samples) < 10:
                self.report.wrong_samples.append(f"{route} prompt {i}: {tokens} != {want}")

    def done(self, c: acb.Completion) -> None:
        self.report.completed += c.finish_reason != "cancelled"
        self.report.cancelled += c.finish_reason == "cancelled"
        if c.metrics.latency_s is not None:
            self.latencies.append(c.metrics.latency_s)
        if c.metrics.ttft_s is not None:
            self.ttfts.append(c.metrics.ttft_s)

    # ------------------------------------------------------------------ one request
    async def request(self, route: str) -> None:
        engine = self.engine
        i = self.rng.randrange(len(self.prompts))
        prompt, n = self.prompts[i], self.rng.randint(4, MAX_NEW)
        kw: dict[str, Any] = {"max_new_tokens": n, "ignore_eos": True}
        try:
            if route in ("stream", "slow"):
                handle, got = engine.submit(prompt, **kw), []
                async for chunk in handle:
                    got.extend(chunk.token_ids)
                    if route == "slow":
                        await asyncio.sleep(self.rng.uniform(0.01, 0.2))
                c = await handle
                self.check_greedy(route, i, got, n)
                self.check_greedy(route, i, c.token_ids, n)
                self.done(c)
            elif route == "break":
                got, chunks, finish = [], self.rng.randint(1, 4), None
                async for chunk in engine.stream(prompt, **kw):
                    got.extend(chunk.token_ids)
                    finish = chunk.finish_reason
                    chunks -= 1
                    if chunks == 0:
                        break  # leaving the loop cancels the request
                self.check_greedy(route, i, got, n if finish else None)
                self.report.completed += finish is not None
                self.report.cancelled += finish is None
            elif route == "generate":
                c = await engine.generate(prompt, **kw)
                self.check_greedy(route, i, c.token_ids, n)
                self.done(c)
            elif route == "batch":
                idx = [self.rng.randrange(len(self.prompts)) for _ in range(4)]
                for j, c in zip(idx, await engine.generate_batch([self.prompts[j] for j in idx], **kw)):
                    self.check_greedy(route, j, c.token_ids, n)
                    self.done(c)
            elif route == "seeded":
                seed = self.rng.randrange(8)
                c = await engine.generate(prompt, max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9,
                                          seed=seed, ignore_eos=True)
                first = self.seeded.setdefault((i, seed), c.token_ids)
                if c.token_ids != first:
                    self.report.wrong_tokens += 1
                    self.report.wrong_samples.append(f"seeded prompt {i} seed {seed}: {c.token_ids} != {first}")
                self.done(c)
            elif route == "task_cancel":
                task = asyncio.ensure_future(engine.generate(prompt, **kw))
                await asyncio.sleep(self.rng.uniform(0, 0.3))
                task.cancel()
                try:
                    c = await task
                except asyncio.CancelledError:
                    self.report.cancelled += 1
                else:
                    self.check_greedy(route, i, c.token_ids, n)
                    self.done(c)
        except Exception as e:  # noqa: BLE001 - every unexpected error is counted
            self.error(route, e)

    # ------------------------------------------------------------------ monitors
    async def ticker(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)
            s = self.engine.stats()
            self.report.peak_live = max(self.report.peak_live, s.running + s.waiting)

    async def sampler(self, t0: float) -> None:
        proc = psutil.Process()
        while True:
            s = self.engine.stats()
            live = s.running + s.waiting
            self.report.rss_mb.append((round(time.perf_counter() - t0, 1), round(proc.memory_info().rss / 2**20, 1),
                                       live))
            await asyncio.sleep(self.args.sample_every)

    # ------------------------------------------------------------------ the run
    async def run(self) -> Report:
        args, rep = self.args, self.report
        print(f"references for {len(self.prompts)} prompts ...", file=sys.stderr)
        self.engine = tiny_engine(num_blocks=args.num_blocks, page_size=16)
        self.refs = [reference_greedy(self.engine.model, p, MAX_NEW) for p in self.prompts]
        routes, weights = zip(*ROUTES.items())
        tasks: set[asyncio.Task] = set()
        async with self.engine:
            t0 = time.perf_counter()
            monitors = [asyncio.create_task(self.ticker()), asyncio.create_task(self.sampler(t0))]
            end, next_burst, last_print = t0 + args.minutes * 60, t0 + args.burst_every, t0
            while (now := time.perf_counter()) < end:
                count = 1
                if now >= next_burst:
                    count, next_burst = args.burst_size, next_burst + args.burst_every
                for _ in range(count):
                    route = self.rng.choices(routes, weights)[0]
                    rep.requests += 1
                    rep.by_route[route] = rep.by_route.get(route, 0) + 1
                    task = asyncio.create_task(self.request(route))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if now - last_print > 15:
                    s = self.engine.stats()
                    print(f"{now - t0:6.0f}s requests={rep.requests} live={s.running + s.waiting} "
                          f"rss={rep.rss_mb[-1][1]:.0f}MB errors={rep.errors} wrong={rep.wrong_tokens}",
                          file=sys.stderr)
                    last_print = now
                await asyncio.sleep(self.rng.expovariate(args.rate))
            if tasks:
                await asyncio.wait(tasks, timeout=120)
            for m in monitors:
                m.cancel()
            await asyncio.gather(*monitors, return_exceptions=True)
            rep.wall_s = round(time.perf_counter() - t0, 1)
            deadline = time.perf_counter() + 10
            stats = self.engine.stats
            while stats().free_blocks != stats().total_blocks and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
            s = self.engine.stats()
            rep.total_blocks, rep.free_blocks_at_end = s.total_blocks, s.free_blocks
            rep.generated_tokens, rep.steps, rep.preemptions = s.generated_tokens, s.steps, s.preemptions
            rep.prefix_hit_rate = round(s.prefix_hit_rate, 3)
            try:
                self.engine.check_integrity()
                rep.integrity_ok = s.running == s.waiting == 0
            except AssertionError as e:
                rep.error_samples.append(f"check_integrity: {e}")
        rep.tokens_per_s = round(rep.generated_tokens / rep.wall_s, 1)
        rep.latency_p50_s, rep.latency_p99_s = (round(percentile(self.latencies, q), 3) for q in (0.5, 0.99))
        rep.ttft_p50_s, rep.ttft_p99_s = (round(percentile(self.ttfts, q), 3) for q in (0.5, 0.99))
        lags_ms = [x * 1000 for x in self.lags]
        rep.loop_lag_ms = {"p50": round(percentile(lags_ms, 0.5), 2), "p99": round(percentile(lags_ms, 0.99), 2),
                           "max": round(max(lags_ms, default=0.0), 2), "samples": len(lags_ms)}
        after_warmup = [mb for t, mb, _ in rep.rss_mb if t >= min(30.0, rep.wall_s / 4)]
        if len(after_warmup) >= 2:
            rep.rss_drift_mb = round(after_warmup[-1] - after_warmup[0], 1)
        return rep


def print_report(rep: Report) -> None:
    rss = [mb for _, mb, _ in rep.rss_mb]
    lines = [
        f"soak: {rep.minutes} min at {rep.rate} req/s + bursts, wall {rep.wall_s} s",
        f"requests       {rep.requests}  ({', '.join(f'{k} {v}' for k, v in sorted(rep.by_route.items()))})",
        f"completions    {rep.completed} finished, {rep.cancelled} cancelled (asked for)",
        f"errors         {rep.errors}" + (f"  e.g. {rep.error_samples[:3]}" if rep.error_samples else ""),
        f"wrong tokens   {rep.wrong_tokens}" + (f"  e.g. {rep.wrong_samples[:2]}" if rep.wrong_samples else ""),
        (f"tokens         {rep.generated_tokens} in {rep.steps} steps ({rep.tokens_per_s}/s), "
         f"{rep.preemptions} preemptions, prefix hit rate {rep.prefix_hit_rate}, peak live {rep.peak_live}"),
        (f"latency        p50 {rep.latency_p50_s} s  p99 {rep.latency_p99_s} s;  "
         f"ttft p50 {rep.ttft_p50_s} s  p99 {rep.ttft_p99_s} s"),
        (f"loop lag (ms)  p50 {rep.loop_lag_ms['p50']}  p99 {rep.loop_lag_ms['p99']}  max {rep.loop_lag_ms['max']}"
         f"  ({rep.loop_lag_ms['samples']} ticks of 5 ms)"),
        (f"rss (MB)       start {rss[0] if rss else 0}  peak {max(rss, default=0)}  end {rss[-1] if rss else 0}  "
         f"drift after warm-up {rep.rss_drift_mb}"),
        "rss series     " + " ".join(f"{t:.0f}s:{mb:.0f}" for t, mb, _ in rep.rss_mb),
        (f"pages          {rep.free_blocks_at_end}/{rep.total_blocks} free at the end; "
         f"check_integrity {'ok' if rep.integrity_ok else 'FAILED'}"),
        f"verdict        {'OK' if rep.ok else 'FAILED'}",
    ]
    print("\n".join(lines))


# ======================================================================= overload soak
async def _overload(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import socket
    import subprocess

    import aiohttp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "acb.cli", "serve", "--port", str(port), "--log-level", "WARNING",
           "--log-interval", "0", "--max-waiting-requests", str(args.max_waiting)]
    cmd += [args.model_dir] if args.model_dir else ["--tiny"]
    if args.num_blocks_serve:
        cmd += ["--num-blocks", str(args.num_blocks_serve)]
    root = __file__.rsplit("/", 2)[0]
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen(cmd, env=env)
    proc = psutil.Process(server.pid)
    url = f"http://127.0.0.1:{port}"
    rep: dict[str, Any] = {"minutes": args.minutes, "factor": args.factor, "max_waiting": args.max_waiting,
                           "statuses": {}, "hangs": 0, "client_errors": [], "health_failures": 0,
                           "health_polls": 0, "rss_mb": []}
    latencies: list[float] = []
    rng = random.Random(args.seed)
    prompts = [f"overload request {i}: name a colour" for i in range(32)]

    async def one(session: aiohttp.ClientSession, i: int, record: bool = True) -> None:
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens, "temperature": 0,
                "stream": i % 2 == 0}
        t = time.perf_counter()
        try:
            async with asyncio.timeout(args.hang_after):
                async with session.post("/v1/completions", json=body) as resp:
                    data = await resp.read()
                    status = resp.status
        except TimeoutError:
            rep["hangs"] += record
            return
        except aiohttp.ClientError as e:
            if record and len(rep["client_errors"]) < 10:
                rep["client_errors"].append(repr(e))
            status = -1
            data = b""
        if not record:
            return
        if status == 200:
            whole = data.rstrip().endswith(b"data: [DONE]") if body["stream"] else b'"finish_reason"' in data
            status = 200 if whole else -2  # -2: a 200 whose body was cut short
            latencies.append(time.perf_counter() - t)
        elif status == 429 and "Retry-After" not in resp.headers:
            status = -3  # a 429 without Retry-After
        rep["statuses"][str(status)] = rep["statuses"].get(str(status), 0) + 1

    async def metric(session: aiohttp.ClientSession, name: str) -> float:
        async with session.get("/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise RuntimeError(f"{name} missing from /metrics")

    async def monitor(session: aiohttp.ClientSession, t0: float) -> None:
        next_rss = 0.0
        while True:
            rep["health_polls"] += 1
            try:
                async with asyncio.timeout(5):
                    async with session.get("/health") as resp:
                        rep["health_failures"] += resp.status != 200
            except (TimeoutError, aiohttp.ClientError):
                rep["health_failures"] += 1
            now = time.perf_counter() - t0
            if now >= next_rss:
                rep["rss_mb"].append((round(now), round(proc.memory_info().rss / 2**20, 1)))
                next_rss += args.sample_every
            await asyncio.sleep(1.0)

    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(base_url=url, connector=connector) as session:
            async with asyncio.timeout(600):  # the server loads its model
                while True:
                    try:
                        async with session.get("/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if server.poll() is not None:
                        raise RuntimeError(f"acb serve exited with {server.returncode}")
                    await asyncio.sleep(0.5)
            # calibration: closed loop, what the server sustains
            done = [0]
            stop_at = time.perf_counter() + args.calibrate

            async def client(c: int) -> None:
                i = c
                while time.perf_counter() < stop_at:
                    await one(session, i, record=False)
                    done[0] += 1
                    i += args.concurrency

            t = time.perf_counter()
            await asyncio.gather(*(client(c) for c in range(args.concurrency)))
            sustained = done[0] / (time.perf_counter() - t)
            rate = sustained * args.factor
            rep["sustained_rps"], rep["offered_rps"] = round(sustained, 2), round(rate, 2)
            print(f"sustained {sustained:.2f} req/s; offering {rate:.2f} req/s for {args.minutes} min",
                  file=sys.stderr)
            t0 = time.perf_counter()
            mon = asyncio.create_task(monitor(session, t0))
            tasks: set[asyncio.Task] = set()
            sent, end, last = 0, t0 + args.minutes * 60, t0
            while (now := time.perf_counter()) < end:
                task = asyncio.create_task(one(session, sent))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
                if now - last > 30:
                    print(f"{now - t0:5.0f}s sent={sent} {rep['statuses']} hangs={rep['hangs']} in flight="
                          f"{len(tasks)} rss={rep['rss_mb'][-1][1] if rep['rss_mb'] else 0}MB", file=sys.stderr)
                    last = now
                await asyncio.sleep(rng.expovariate(rate))
            if tasks:
                await asyncio.wait(tasks, timeout=args.hang_after + 10)
            mon.cancel()
            await asyncio.gather(mon, return_exceptions=True)
            rep["sent"], rep["wall_s"] = sent, round(time.perf_counter() - t0, 1)
            rep["unanswered"] = sent - sum(rep["statuses"].values()) - rep["hangs"]
            async with asyncio.timeout(30):
                while await metric(session, "acb_kv_free_blocks") != await metric(session, "acb_kv_total_blocks"):
                    await asyncio.sleep(0.2)
            rep["free_blocks"] = await metric(session, "acb_kv_free_blocks")
            rep["total_blocks"] = await metric(session, "acb_kv_total_blocks")
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    rep["latency_s"] = {q: round(percentile(latencies, v), 3) for q, v in (("p50", 0.5), ("p99", 0.99))}
    rep["latency_s"]["max"] = round(max(latencies, default=0.0), 3)
    after = [mb for t, mb in rep["rss_mb"] if t >= min(60, rep["wall_s"] / 4)]
    rep["rss_drift_mb"] = round(after[-1] - after[0], 1) if len(after) >= 2 else 0.0
    rep["ok"] = (rep["hangs"] == 0 and rep["unanswered"] == 0 and set(rep["statuses"]) <= {"200", "429"}
                 and rep["health_failures"] == 0 and rep["free_blocks"] == rep["total_blocks"])
    return rep


def print_overload(rep: dict[str, Any]) -> None:
    rss = [mb for _, mb in rep["rss_mb"]]
    print("\n".join([
        f"overload soak: {rep['minutes']} min at {rep['factor']}x the sustained rate "
        f"({rep['sustained_rps']} -> {rep['offered_rps']} req/s), max_waiting_requests={rep['max_waiting']}",
        f"requests       {rep['sent']} sent: {rep['statuses']}; hangs {rep['hangs']}; unanswered {rep['unanswered']}",
        f"latency (200s) p50 {rep['latency_s']['p50']} s  p99 {rep['latency_s']['p99']} s  "
        f"max {rep['latency_s']['max']} s",
        f"/health        {rep['health_polls'] - rep['health_failures']}/{rep['health_polls']} answered 200",
        f"server rss MB  start {rss[0] if rss else 0}  peak {max(rss, default=0)}  end {rss[-1] if rss else 0}  "
        f"drift after warm-up {rep['rss_drift_mb']}",
        "rss series     " + " ".join(f"{t}s:{mb:.0f}" for t, mb in rep["rss_mb"]),
        f"pages          {rep['free_blocks']:.0f}/{rep['total_blocks']:.0f} free at the end",
        f"verdict        {'OK' if rep['ok'] else 'FAILED'}",
    ]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to keep submitting (default 3)")
    ap.add_argument("--rate", type=float, default=20.0, help="mean Poisson arrivals per second (default 20)")
    ap.add_argument("--burst-every", type=float, default=15.0, help="seconds between bursts (default 15)")
    ap.add_argument("--burst-size", type=int, default=100, help="requests per burst (default 100)")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    ap.add_argument("--num-blocks", type=int, default=256, help="KV pages of 16 tokens (default 256)")
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts (default 24)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    ap.add_argument("--json", help="also write the report here")
    ov = ap.add_argument_group("--overload: open-loop arrivals beyond capacity against acb serve")
    ov.add_argument("--overload", action="store_true", help="run the overload soak instead")
    ov.add_argument("--model-dir", help="model folder for acb serve (default: the tiny test model)")
    ov.add_argument("--factor", type=float, default=10.0, help="offered / sustained rate (default 10)")
    ov.add_argument("--calibrate", type=float, default=30.0, help="seconds measuring the sustained rate (default 30)")
    ov.add_argument("--concurrency", type=int, default=32, help="closed-loop clients while calibrating (default 32)")
    ov.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    ov.add_argument("--max-waiting", type=int, default=64, help="the server's --max-waiting-requests (default 64)")
    ov.add_argument("--num-blocks-serve", type=int, default=0, help="the server's --num-blocks (default: its own)")
    ov.add_argument("--hang-after", type=float, default=120.0, help="seconds without an answer = a hang (default 120)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0:
        ap.error("--minutes and --rate must be > 0")
    if args.overload:
        rep = asyncio.run(_overload(args))
        print_overload(rep)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1)
        return 0 if rep["ok"] else 1
    soak = Soak(args)
    if args.uvloop:
        import uvloop

        rep = uvloop.run(soak.run())
    else:
        rep = asyncio.run(soak.run())
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(rep) | {"ok": rep.ok}, f, indent=1)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())

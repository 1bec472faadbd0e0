"""Time to first token with a long shared prefix on SmolLM2-135M: computed (cold), from the
engine's pages (warm), and after a process restart, from the prefix cache's disk tier
(``EngineConfig.kv_disk_path``).

    python benchmarks/kv_disk.py                        # float32, an 8,000-token prefix
    python benchmarks/kv_disk.py --dtype bfloat16 --prefix 8000 --repeat 3

Two processes per dtype, on a fresh directory: the first computes ``prefix + question 1``
(cold), then ``prefix + question 2`` (warm: the prefix's pages are in the engine) and closes,
its page files written; the second, a new process, asks ``prefix + question 3`` (from disk: the
pages are read, checked and loaded, the question computed), then ``prefix + question 4`` (warm
again). After each request the process waits for the disk tier's writes to finish, so the copy
of the prefix's pages out of the KV tensors (on the step thread, once, after the cold request:
reported apart as ``disk_copy_s``) is in no TTFT. Each process first answers a short unrelated
prompt, so no figure pays for first-use setup. TTFT is the request's own
(``Completion.metrics.ttft_s``); 1 new token each. The page files were just written, so "from
disk" reads them from the OS page cache (the usual case for a restart on a machine with free
memory); a cold disk adds its read time for the bytes reported. Writes --out (default
bench-results/kv_disk.json).
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import acb
from acb.model.loading import smollm2


async def _child(args: argparse.Namespace) -> dict:
    folder, gguf = smollm2()
    config = acb.EngineConfig(dtype=args.dtype, kv_disk_path=args.dir, kv_disk_space=args.space,
                              num_blocks=(args.prefix + 256) // 16 * 2, max_batch_tokens=2048)
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf, config=config)
    rng = random.Random(62)
    vocab = engine.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix)]
    questions = [[rng.randrange(100, vocab) for _ in range(24)] for _ in range(4)]
    out: dict = {}
    async with engine:
        await engine.generate([rng.randrange(100, vocab) for _ in range(40)], max_new_tokens=2)  # first use
        first, second = (0, 1) if args.child == "write" else (2, 3)
        done = []
        for q in (first, second):
            done.append(await engine.generate(prefix + questions[q], max_new_tokens=1, temperature=0))
            while not engine.kv.disk.idle():  # the prefix's pages copied out and written: not in the next TTFT
                await asyncio.sleep(0.01)
    names = ("cold", "warm") if args.child == "write" else ("disk", "warm_after_restart")
    for name, c in zip(names, done, strict=True):
        out[name] = {"ttft_s": c.metrics.ttft_s, "cached_prompt_tokens": c.metrics.num_cached_prompt_tokens,
                     "prompt_tokens": c.metrics.num_prompt_tokens, "token": c.token_ids}
    stats = engine.stats()  # after close: every write finished
    out["stats"] = {k: getattr(stats, k) for k in ("disk_hits", "disk_pages_read", "disk_pages_written",
                                                   "disk_bytes_read", "disk_bytes_written", "disk_errors",
                                                   "disk_load_s", "disk_copy_s", "forward_path", "dtype")}
    return out


def _run(child: str, args: argparse.Namespace, directory: str) -> dict:
    cmd = [sys.executable, __file__, "--child", child, "--dir", directory, "--dtype", args.dtype,
           "--prefix", str(args.prefix), "--space", str(args.space)]
    root = str(Path(__file__).resolve().parent.parent)  # the checkout this script is in, not an installed acb
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{child} process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prefix", type=int, default=8000, help="tokens of the shared prefix")
    p.add_argument("--repeat", type=int, default=1, help="pairs of processes (medians reported)")
    p.add_argument("--space", type=float, default=8.0, help="kv_disk_space, GiB")
    p.add_argument("--out", default="bench-results/kv_disk.json")
    p.add_argument("--child", choices=("write", "read"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args))))
        return
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="acb-kv-disk-") as directory:
            start = time.perf_counter()
            wrote = _run("write", args, directory)
            files = list(Path(directory).glob("*.kvp"))
            read = _run("read", args, directory)
            runs.append({**wrote, **read, "files": len(files), "file_bytes": sum(f.stat().st_size for f in files),
                         "wall_s": time.perf_counter() - start, "write_stats": wrote["stats"],
                         "read_stats": read["stats"]})
    med = {k: statistics.median(r[k]["ttft_s"] for r in runs) for k in ("cold", "warm", "disk", "warm_after_restart")}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"dtype": args.dtype, "prefix_tokens": args.prefix, "ttft_s": med,
              "cold_over_disk": med["cold"] / med["disk"], "disk_over_warm": med["disk"] / med["warm"],
              "runs": runs, "cpu": cpu, "cores": os.cpu_count(), "torch_threads": os.environ.get("OMP_NUM_THREADS"),
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "source": "python benchmarks/kv_disk.py " + " ".join(sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    r = runs[-1]
    print(f"SmolLM2-135M {args.dtype}, {args.prefix}-token prefix, {cpu}, {os.cpu_count()} cores")
    print(f"  TTFT cold (computed)         {med['cold'] * 1e3:9.1f} ms")
    print(f"  TTFT warm (in pages)         {med['warm'] * 1e3:9.1f} ms")
    print(f"  TTFT after restart (disk)    {med['disk'] * 1e3:9.1f} ms   "
          f"({r['read_stats']['disk_hits']} pages, {r['read_stats']['disk_bytes_read'] / 2**20:.0f} MiB read, "
          f"{r['read_stats']['disk_load_s'] * 1e3:.0f} ms reading and checking)")
    print(f"  TTFT warm after restart      {med['warm_after_restart'] * 1e3:9.1f} ms")
    print(f"  copying the pages out for the writer took {r['write_stats']['disk_copy_s'] * 1e3:.0f} ms of the "
          f"step thread, once (not in the figures: each request waits for the writes before the next)")
    print(f"  cold / disk = {result['cold_over_disk']:.1f}x   disk / warm = {result['disk_over_warm']:.2f}x   "
          f"({r['files']} files, {r['file_bytes'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()

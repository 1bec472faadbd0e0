"""acb against its peers, in one run, on the same seeded workload.

    python benchmarks/bench.py                          # standard workload: acb, HF generate_batch, HF generate
    python benchmarks/bench.py --workload prefix        # shared 400-token system prompt
    python benchmarks/bench.py --workload stream --rate 2
    python benchmarks/bench.py --vllm-venv ~/vllm-venv  # adds vLLM's CPU engine (or set ACB_VLLM_VENV)
    python benchmarks/bench.py --systems acb_fp32,acb_bf16,vllm,vllm_fp32 --vllm-venv ~/vllm-venv  # dtypes
    python benchmarks/bench.py --systems acb_fp32,acb_bf16,acb_int8,acb_int8_bf16  # + int8 weights
    python benchmarks/bench.py --systems acb_fp32,acb_int8,acb_gguf --rounds 3  # + the GGUF file at its widths
    python benchmarks/bench.py --systems acb_bf16,acb_bf16_kv8,acb_int8_bf16_kv8  # + int8 KV pages
    python benchmarks/bench.py --systems acb --limit 16 # quick look
    python benchmarks/bench.py --systems acb_fp32,acb_int8_bf16 --rounds 3  # ratios, rounds interleaved
    python benchmarks/bench.py --workload realtext --seed 3 --systems acb_fp32,acb_int8_bf16  # other passages
    python benchmarks/bench.py --shape qwen2.5-0.5b --limit 16 --systems acb_fp32,acb_int8,vllm_fp32 --rounds 3

Each system runs in its own process, so peak RSS is its own. With --rounds N the systems run N times
in turn (A B A B ...: a host's drift between minutes lands on every system alike); each system's row is
its median round, and each round's tok/s over the first system's in the same round is printed (a ratio
between two systems read from one run each moved by ~5 % either way here). Prints a table,
writes JSON (default bench-results/<workload>.json, every TTFT and ITL sample
included) and renders its plots next to it (bench-results/img/<workload>/, see
plots.py; docs/img/ is rendered from the recorded runs in benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402

# acb: its default dtype here (Engine.from_pretrained's); vllm: its default (dtype="auto": bf16 on x86);
# the _fp32 / _bf16 variants force a dtype
# acb_int8: int8 weights and activations in the GEMMs (EngineConfig.quantization="int8"), float32 between
# them; acb_int8_bf16: the same with bfloat16 between them (and bf16 KV pages); a _kv8 suffix adds int8 KV
# pages (EngineConfig.kv_cache_dtype="int8"); acb_gguf / acb_gguf_bf16: the GGUF file at its own widths
# (EngineConfig.quantization="gguf", SmolLM2's Q4_1; not with --shape, whose models are folders)
SYSTEMS = ("acb", "acb_fp32", "acb_bf16", "acb_int8", "acb_int8_bf16", "acb_gguf", "acb_gguf_bf16", "acb_fp32_kv8",
           "acb_bf16_kv8", "acb_int8_kv8", "acb_int8_bf16_kv8", "hf_generate_batch", "hf_generate", "vllm", "vllm_fp32",
           "vllm_bf16")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "float32", "int8_bf16": "bfloat16", "gguf": "float32",
           "gguf_bf16": "bfloat16"}


def matrix_ceiling(w: workloads.Workload) -> dict:
    """Generated tok/s this machine could reach if it did nothing but the workload's
    linear-layer matmuls at the fp32 throughput measured on the model's own shapes."""
    import torch
    from systems import load_model

    model, _ = load_model()
    layer_linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    per_token = sum(m.weight.numel() for m in layer_linears)
    lm_head = model.get_output_embeddings().weight.numel()
    generated = w.max_new_tokens * len(w.prompts)
    flops = 2 * per_token * (w.prompt_tokens + generated) + 2 * lm_head * generated
    rows = 2048  # acb's CPU prefill chunk; most of the workload's FLOPs are prefill
    x = torch.randn(rows, model.config.hidden_size)
    h = torch.randn(rows, model.config.intermediate_size)
    layer = model.model.layers[0]
    shapes = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
              layer.mlp.gate_proj, layer.mlp.up_proj]

    def layer_time(linear) -> float:
        for _ in range(3):
            for m in shapes:
                linear(m, x)
            linear(layer.mlp.down_proj, h)
        t0 = time.perf_counter()
        reps = 10
        for _ in range(reps):
            for m in shapes:
                linear(m, x)
            linear(layer.mlp.down_proj, h)
        return (time.perf_counter() - t0) / reps

    # The machine's best fp32 GEMM: F.linear, or oneDNN with prepacked weights (what acb uses)
    with torch.inference_mode():
        dt = layer_time(lambda m, inp: torch.nn.functional.linear(inp, m.weight))
        if torch.backends.mkldnn.is_available():
            mods = shapes + [layer.mlp.down_proj]
            packed = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight, None) for m in mods}
            dt = min(dt, layer_time(lambda m, inp: torch.ops.mkldnn._linear_pointwise(inp, packed[m], None, "none",
                                                                                       [], "")))
    layer_flops = 2 * rows * sum(m.weight.numel() for m in shapes + [layer.mlp.down_proj])
    gflops = layer_flops / dt / 1e9
    return {"linear_tflop": flops / 1e12, "gflops_measured": gflops,
            "ceiling_tok_per_s": generated / (flops / (gflops * 1e9))}


def child(system: str, args: argparse.Namespace) -> dict:
    import systems

    w = workloads.build(args.workload, args.workload_file, args.limit, args.rate, args.seed)
    systems.SHAPE = args.shape
    if system == "acb" or system.startswith("acb_"):
        config = json.loads(args.acb_config) if args.acb_config else {}
        if system.endswith("_kv8"):
            config["kv_cache_dtype"] = "int8"
        return systems.run_acb(w, config or None, _DTYPES.get(system.removeprefix("acb_").removesuffix("_kv8")),
                               "int8" if system.startswith("acb_int8") else
                               "gguf" if system.startswith("acb_gguf") else None)
    if system == "hf_generate_batch":
        return systems.run_hf_generate_batch(w)
    if system == "hf_generate":
        return systems.run_hf_generate(w, batch_size=args.hf_batch_size)
    if system == "vllm" or system.startswith("vllm_"):
        return systems.run_vllm(w, args.vllm_venv, _DTYPES.get(system.removeprefix("vllm_"), "auto"))
    if system == "ceiling":
        return matrix_ceiling(w)
    raise ValueError(system)


def run_in_subprocess(system: str, argv: list[str]) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(HERE / "bench.py"), *argv, "--child", system, "--child-out", out]
    print(f"-- {system} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if proc.returncode != 0:
        print(f"-- {system} failed (exit {proc.returncode})", file=sys.stderr)
        return None
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    print(f"-- {system} done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return res


def median_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Each system's median round (by tok/s; the lower middle of an even count), in the order they ran,
    with every round's tok/s as ``rounds_tok_per_s`` where there was more than one."""
    by_system: dict[str, list[dict]] = {}
    for results in rounds:
        for r in results:
            by_system.setdefault(r["system"], []).append(r)
    out = []
    for runs in by_system.values():
        ranked = sorted(runs, key=lambda r: r["tok_per_s"])
        pick = dict(ranked[(len(ranked) - 1) // 2])
        if len(runs) > 1:
            pick["rounds_tok_per_s"] = [r["tok_per_s"] for r in runs]
        out.append(pick)
    return out


def round_ratios(rounds: list[list[dict]], first: str) -> str:
    """Each system's tok/s over system ``first``'s, round by round (the rounds where both ran)."""
    lines = [f"tok/s over {first}'s in the same round:"]
    names = list(dict.fromkeys(r["system"] for results in rounds for r in results if r["system"] != first))
    for name in names:
        ratios = []
        for results in rounds:
            base = next((r for r in results if r["system"] == first), None)
            this = next((r for r in results if r["system"] == name), None)
            if base and this:
                ratios.append(this["tok_per_s"] / base["tok_per_s"])
        if ratios:
            lines.append(f"  {name:<20} " + " ".join(f"{x:.2f}" for x in ratios)
                         + f"   (median {sorted(ratios)[(len(ratios) - 1) // 2]:.2f})")
    return "\n".join(lines)


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[dict], ceiling: dict | None) -> str:
    acb = next((r for r in results if r["system"].startswith("acb")), None)
    head = (f"{'system':<22}{'tok/s':>8}{'req/s':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
            f"{'RSS GiB':>9}{'acb x':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = acb["tok_per_s"] / r["tok_per_s"] if acb and r is not acb else None
        lines.append(
            f"{r['system']:<22}{r['tok_per_s']:>8.1f}{r['req_per_s']:>7.2f}{fmt(r['ttft_p50_s'], '.2f'):>10}"
            f"{fmt(r['ttft_p99_s'], '.2f'):>10}{fmt(r['itl_p50_s'] and 1e3 * r['itl_p50_s'], '.0f'):>7}ms"
            f"{fmt(r['itl_p99_s'] and 1e3 * r['itl_p99_s'], '.0f'):>7}ms{r['peak_rss_gib']:>9.2f}{fmt(ratio, '.2f'):>7}"
        )
    if acb:
        lines.append(f"acb event-loop lag: p50 {acb['loop_lag_p50_ms']:.2f} ms, p99 {acb['loop_lag_p99_ms']:.2f} ms, "
                     f"max {acb['loop_lag_max_ms']:.1f} ms; {acb['steps']} steps")
    if ceiling:
        line = (f"matrix ceiling: {ceiling['linear_tflop']:.2f} TFLOP of linear layers at "
                f"{ceiling['gflops_measured']:.0f} GFLOP/s -> {ceiling['ceiling_tok_per_s']:.0f} tok/s")
        if acb:
            line += f"; acb reaches {acb['tok_per_s'] / ceiling['ceiling_tok_per_s']:.0%} of it"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="standard", choices=["standard", "prefix", "stream", "realtext"])
    p.add_argument("--workload-file", default=None, help="standard-workload.json (default: ../shared/bench)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second for --workload stream")
    p.add_argument("--seed", type=int, default=0,
                   help="--workload realtext: which passages (0, the default: the recorded prompts; others cut "
                        "other windows of the same texts)")
    p.add_argument("--shape", default="smollm2", help="the model: smollm2 (the real one) or a popular model's "
                   "shape with random weights, EOS ignored (benchmarks/shapes.py: qwen2.5-0.5b, qwen2.5-1.5b, "
                   "qwen3-0.6b, llama-3.2-1b)")
    p.add_argument("--systems", default=None, help=f"comma list from {SYSTEMS}")
    p.add_argument("--vllm-venv", default=os.environ.get("ACB_VLLM_VENV"))
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--acb-config", default=None, help="JSON of EngineConfig fields for acb")
    p.add_argument("--rounds", type=int, default=1, help="run the systems N times in turn; rows: each's median")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.seed != 0 and args.workload != "realtext":
        p.error(f"--seed picks the realtext workload's passages; --workload {args.workload} has none to pick")
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args)))
        return

    argv = [a for a in sys.argv[1:]]
    if args.systems:
        systems = args.systems.split(",")
    else:
        systems = ["acb", "hf_generate_batch", "hf_generate"] + (["vllm"] if args.vllm_venv else [])
        if args.workload == "stream":
            systems = ["acb"]  # the peers here have no streaming arrival API comparable in one process
    rounds = [[r for s in systems if (r := run_in_subprocess(s, argv)) is not None] for _ in range(args.rounds)]
    results = median_rounds(rounds)
    ceiling = run_in_subprocess("ceiling", argv)
    print(table(results, ceiling))
    if args.rounds > 1:
        print(round_ratios(rounds, systems[0]))
    out = Path(args.out or f"bench-results/{args.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "workload": args.workload, "shape": args.shape, "seed": args.seed, "limit": args.limit, "rounds": args.rounds,
        "results": results,
        "ceiling": ceiling,
        "source": "python benchmarks/bench.py " + " ".join(sys.argv[1:]),
    }
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")
    if results:
        try:  # here, in the parent only: matplotlib in a measured child added ~25 MB to its peak RSS
            import plots
        except ImportError as e:  # an environment without matplotlib (a user's install): numbers only
            print(f"no plots ({e})")
            return
        for path in plots.render_run(data, out.parent / "img" / args.workload):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

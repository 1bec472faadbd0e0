"""Plots of measured benchmark results (matplotlib), for docs/performance.md.

    python benchmarks/plots.py                         # benchmarks/results/*.json -> docs/img/*.png
    python benchmarks/plots.py --results bench-results --out bench-results/img

Reads the JSON that bench.py and scaling.py write (and the recorded runs in
benchmarks/results/, the same schema plus their date and source) and draws only
what those files hold: no number is made up here. For each kind of result the
newest file (by name) is used; the latency plots show every streaming run.

- throughput_vs_concurrency.png: scaling.py's sweeps (tok/s against concurrent
  requests and against prompt length);
- peers.png: a bench.py run's systems, acb against each peer (tok/s, acb's ratio);
- latency.png: TTFT and inter-token latency, p50-p99 per system and workload;
- latency_cdf.png: their whole distribution, for runs that kept every sample;
- gpu.png: the GPU check's throughput table;
- speculative.png: speculative.py's run, per-stream tok/s and ITL p50 with and without n-gram
  speculation per workload and concurrency.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

HERE = Path(__file__).resolve().parent
ACB_COLOUR, PEER_COLOUR = "#1f77b4", "#9a9a9a"


def newest(results: Path, prefix: str) -> dict | None:
    """The newest ``<prefix>*.json`` in ``results`` (file names carry the date), or None."""
    files = sorted(results.glob(f"{prefix}*.json"))
    return json.loads(files[-1].read_text()) if files else None


def caption(data: dict) -> str:
    return f"{data.get('date', '')} · {data.get('machine', '')}".strip(" ·")


def label(row: dict) -> str:
    return row.get("label") or row["system"]


def save(fig, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(data: dict, out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    conc, lengths, earlier = data["concurrency"], data["lengths"], data.get("earlier")
    for ax, sweep, key, xlabel, title in (
        (left, conc, "requests", "concurrent requests",
         f"prompts of {conc.get('prompt_len', '?')} tokens, {conc.get('new_tokens', '?')} new each"),
        (right, lengths, "length", "prompt length (tokens)",
         f"{lengths.get('requests', '?')} requests, {lengths.get('new_tokens', '?')} new tokens each"),
    ):
        xs = [r[key] for r in sweep["rows"]]
        ax.plot(xs, [r["tok_per_s"] for r in sweep["rows"]], "o-", color=ACB_COLOUR, label="acb")
        series = earlier and earlier.get("concurrency_tok_per_s" if key == "requests" else "lengths_tok_per_s")
        if series and len(series) == len(xs):
            ax.plot(xs, series, "o--", color=PEER_COLOUR, label=f"acb, {earlier['label']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"acb throughput ({caption(data)})", fontsize=9)
    return save(fig, out, "throughput_vs_concurrency.png")


def plot_peers(runs: list[dict], out: Path) -> Path:
    """One panel per bench.py run (workload): tok/s per system, acb's ratio to each peer."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.6), squeeze=False)
    for ax, data in zip(axes[0], runs):
        rows = sorted(data["results"], key=lambda r: r["tok_per_s"])
        acbs = [r for r in rows if r["system"].startswith("acb")]
        colours = [ACB_COLOUR if r["system"].startswith("acb") else PEER_COLOUR for r in rows]
        bars = ax.barh([label(r) for r in rows], [r["tok_per_s"] for r in rows], color=colours)
        for bar, r in zip(bars, rows):
            text = f"{r['tok_per_s']:.1f}"
            # a peer is compared with acb in its own dtype where the run has it (runs without
            # dtypes: the one acb row)
            acb = next((a for a in acbs if a.get("dtype") and a.get("dtype") == r.get("dtype")),
                       acbs[0] if acbs else None)
            if acb is not None and not r["system"].startswith("acb"):
                text += f"   (acb {acb['tok_per_s'] / r['tok_per_s']:.2f}×)"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
        ax.set_xlim(0, 1.45 * max(r["tok_per_s"] for r in rows))
        ax.set_xlabel("generated tokens/s")
        ax.set_title(f"{data.get('workload', '')} workload · {data.get('date', '')}", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    return save(fig, out, "peers.png")


LATENCY = (("ttft", "time to first token"), ("itl", "inter-token latency"))


def plot_latency(runs: list[dict], out: Path) -> Path:
    """TTFT and ITL of each system and workload as its p50-p99 range (log scale)."""
    rows = [(f"{label(r)}\n{d.get('workload', '')}, {d.get('date', '')}", r) for d in runs for r in d["results"]
            if r.get("ttft_p50_s") is not None or r.get("itl_p50_s") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.2 + 0.62 * len(rows)), sharey=True)
    for ax, (kind, title) in zip(axes, LATENCY):
        for y, (_, r) in enumerate(rows):
            p50, p99 = r.get(f"{kind}_p50_s"), r.get(f"{kind}_p99_s")
            if p50 is None:
                continue
            colour = ACB_COLOUR if r["system"].startswith("acb") else PEER_COLOUR
            ax.plot([p50, p99], [y, y], "-", lw=6, alpha=0.45, color=colour, solid_capstyle="butt")
            ax.plot([p50], [y], "o", color=colour)
            ax.plot([p99], [y], "|", ms=14, color=colour)
            ax.annotate(f"p50 {p50:.3g} s · p99 {p99:.3g} s", (p99, y), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax.set_xscale("log")
        ax.margins(x=0.6)
        ax.set_xlabel("seconds (log scale): dot = p50, bar end = p99")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
    axes[0].invert_yaxis()
    return save(fig, out, "latency.png")


def plot_latency_cdf(runs: list[dict], out: Path) -> Path | None:
    """The distribution (CDF) of TTFT and ITL for the runs that kept every sample; None if none did."""
    kept = [(d, r) for d in runs for r in d["results"] if r.get("ttft_samples_s") or r.get("itl_samples_s")]
    if not kept:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (kind, title) in zip(axes, LATENCY):
        for d, r in kept:
            samples = sorted(r.get(f"{kind}_samples_s") or [])
            if samples:
                ax.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post",
                        label=f"{label(r)}, {d.get('workload', '')} ({d.get('date', '')}, {len(samples)} samples)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("seconds (log scale)")
        ax.set_ylabel("fraction of samples at or below")
        ax.set_title(f"{title}: distribution", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    return save(fig, out, "latency_cdf.png")


def plot_gpu(data: dict, out: Path) -> Path:
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    series = (("acb_async_on_tok_per_s", "acb, async batching on", ACB_COLOUR),
              ("acb_async_off_tok_per_s", "acb, async batching off", "#6baed6"),
              ("hf_generate_batch_tok_per_s", "transformers generate_batch", PEER_COLOUR))
    width = 0.8 / len(series)
    for i, (key, name, colour) in enumerate(series):
        ax.bar([j + i * width for j in range(len(rows))], [r[key] for r in rows], width, label=name, color=colour)
    ax.set_xticks([j + width for j in range(len(rows))], [f"{r['model']}\n{r['requests']} requests" for r in rows],
                  fontsize=8)
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{data.get('machine', 'GPU')}, {data.get('model', '')} · {data.get('date', '')}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, out, "gpu.png")


def plot_speculative(data: dict, out: Path) -> Path:
    rows = data["results"]
    keys = [(r["workload"], r["concurrency"]) for r in rows if r["method"] == "none"]
    by = {(r["workload"], r["concurrency"], r["method"]): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(keys))
    names = [f"{w}\n{c} stream{'s' if c > 1 else ''}" for w, c in keys]
    for ax, field, title in ((left, "per_stream_tok_s_p50", "per-stream generated tok/s (p50)"),
                             (right, "itl_p50_ms", "inter-token latency p50 (ms)")):
        for k, (method, colour) in enumerate((("none", PEER_COLOUR), ("ngram", ACB_COLOUR))):
            values = [by[(w, c, method)][field] for w, c in keys]
            ax.bar([i + (k - 0.5) * 0.38 for i in x], values, 0.38, color=colour,
                   label="no speculation" if method == "none" else "ngram")
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_title(title, fontsize=10)
    for i, (w, c) in enumerate(keys):
        base, spec = by[(w, c, "none")]["per_stream_tok_s_p50"], by[(w, c, "ngram")]["per_stream_tok_s_p50"]
        left.annotate(f"{spec / base:.2f}x", (i + 0.19, spec), ha="center", va="bottom", fontsize=8)
    left.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, speculative_method='ngram' vs none ({caption(data)})", fontsize=10)
    return save(fig, out, "speculative.png")


def render_all(results: Path, out: Path) -> list[Path]:
    """Every plot the files in ``results`` can give, written to ``out``."""
    written = []
    if scaling := newest(results, "scaling"):
        written.append(plot_scaling(scaling, out))
    runs = [d for kind in ("standard", "prefix") if (d := newest(results, kind))]
    if runs:
        written.append(plot_peers(runs, out))
    latency_runs = runs[:1] + [json.loads(f.read_text()) for f in sorted(results.glob("stream*.json"))]
    if latency_runs:
        written.append(plot_latency(latency_runs, out))
    written += [p for p in (plot_latency_cdf(latency_runs, out),) if p]
    if gpu := newest(results, "gpu"):
        written.append(plot_gpu(gpu, out))
    if speculative := newest(results, "speculative"):
        written.append(plot_speculative(speculative, out))
    return written


def render_run(data: dict, out: Path) -> list[Path]:
    """The plots of one bench.py run (its JSON as a dict)."""
    paths = [plot_latency([data], out)] + [p for p in (plot_latency_cdf([data], out),) if p]
    if len(data["results"]) > 1:
        paths.append(plot_peers([data], out))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img")
    args = p.parse_args()
    for path in render_all(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

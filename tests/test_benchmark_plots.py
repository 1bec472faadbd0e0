"""benchmarks/plots.py draws every docs/img plot from the recorded results, and a bench.py run's
own JSON into plots too."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import plots  # noqa: E402  (benchmarks/plots.py; matplotlib comes with the test extra)

PNG = b"\x89PNG\r\n\x1a\n"


def test_recorded_results_render_every_plot_performance_md_shows(tmp_path):
    written = {p.name for p in plots.render_all(BENCHMARKS / "results", tmp_path)}
    performance_md = (BENCHMARKS.parent / "docs" / "performance.md").read_text()
    shown = set(re.findall(r"\(img/([\w.]+\.png)\)", performance_md))
    assert shown and shown <= written
    assert all((tmp_path / name).read_bytes()[:8] == PNG for name in written)


def test_recorded_results_name_their_date_and_source():
    for path in (BENCHMARKS / "results").glob("*.json"):
        data = json.loads(path.read_text())
        assert data.get("date", "").startswith("20") and data.get("source"), path.name


def test_a_bench_run_renders_its_latency_distribution_from_its_samples(tmp_path):
    run = {"date": "today", "workload": "stream", "results": [
        {"system": "acb", "tok_per_s": 10.0, "ttft_p50_s": 0.2, "ttft_p99_s": 0.5, "itl_p50_s": 0.04,
         "itl_p99_s": 0.3, "ttft_samples_s": [0.1, 0.2, 0.5], "itl_samples_s": [0.03, 0.04, 0.3]}]}
    assert {p.name for p in plots.render_run(run, tmp_path)} == {"latency.png", "latency_cdf.png"}


def test_bench_rounds_keep_each_systems_median_round_and_print_ratios_round_by_round():
    import bench  # benchmarks/bench.py

    def run(system, tok, ttft):
        return {"system": system, "tok_per_s": tok, "ttft_p50_s": ttft}

    rounds = [[run("acb_fp32", 300.0, 1.0), run("acb_int8_bf16", 690.0, 0.1)],
              [run("acb_fp32", 280.0, 2.0), run("acb_int8_bf16", 770.0, 0.2)],
              [run("acb_fp32", 290.0, 3.0), run("acb_int8_bf16", 720.0, 0.3)]]
    rows = bench.median_rounds(rounds)
    # the median round as it ran (its own latencies with it), every round's tok/s beside it, in run order
    assert [(r["system"], r["tok_per_s"], r["ttft_p50_s"]) for r in rows] == [
        ("acb_fp32", 290.0, 3.0), ("acb_int8_bf16", 720.0, 0.3)]
    assert rows[1]["rounds_tok_per_s"] == [690.0, 770.0, 720.0]
    assert "rounds_tok_per_s" not in bench.median_rounds(rounds[:1])[0]
    text = bench.round_ratios(rounds, "acb_fp32")
    assert "over acb_fp32's" in text
    # 690/300, 770/280, 720/290 in round order, and their median
    assert "2.30 2.75 2.48   (median 2.48)" in text
    # a round where the first system failed gives no ratio (the others' rounds keep theirs)
    assert "2.75 2.48   (median 2.48)" in bench.round_ratios([rounds[0][1:], *rounds[1:]], "acb_fp32")

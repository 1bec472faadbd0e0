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

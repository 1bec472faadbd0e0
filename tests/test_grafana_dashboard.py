"""examples/grafana/acb-dashboard.json queries only metrics that acb serve's /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from acb.integrations.metrics import ServerMetrics
from acb.testing import tiny_engine

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "acb-dashboard.json"


def queried_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return {name for e in exprs for name in re.findall(r"\bacb_[a-z_]+", e)}


async def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    metrics = ServerMetrics()
    async with tiny_engine() as engine:
        metrics.observe(await engine.generate("hello", max_new_tokens=4))
        exported = set(re.findall(r"^(acb_[a-z_]+)", metrics.render(engine.stats()), re.M))
    queried = queried_metrics(dashboard)
    assert len(queried) >= 10
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_dashboard_panels_have_unique_ids_and_a_datasource_input():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"] if p["type"] != "row")

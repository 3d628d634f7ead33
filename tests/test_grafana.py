"""The Grafana dashboard in examples/grafana queries only metrics kvtier exports."""

import json
import re
from pathlib import Path

import pytest
from kvtier_testing.running import FUTURE_STATS, free_port, run_engine

from kvtier.metrics import StatsCollector
from kvtier.metrics.names import METRICS
from kvtier.metrics.view import parse_text

prometheus_client = pytest.importorskip("prometheus_client")

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "kvtier.json"
_NAME = re.compile(r"\bkvtier_[a-zA-Z0-9_]+")


def queried_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    names = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            found = _NAME.findall(target["expr"])
            assert found, (panel["title"], target["expr"])
            names.update(found)
    return names


def exposed(page: str) -> set[str]:
    return {name for name, _, _ in parse_text(page)}


def test_every_metric_the_dashboard_queries_is_exported(tmp_path):
    # what a real stack serves on loopback after a workload ...
    port = free_port()
    engine = run_engine(tmp_path, {"port": port})
    try:
        import urllib.request

        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        engine.close()
    live = exposed(page)
    # ... and what the keys of the miss causes, budget admission and a shared tier become
    registry = prometheus_client.CollectorRegistry()
    registry.register(StatsCollector(lambda: FUTURE_STATS))
    future = exposed(prometheus_client.generate_latest(registry).decode())
    documented = {m.name for m in METRICS} | {m.name + "_bucket" for m in METRICS if m.kind == "histogram"}
    queried = queried_names()
    assert queried - (live | future) == set(), "the dashboard queries metrics nobody exports"
    assert queried <= documented
    # the dashboard covers what the issue asks for
    for needed in (
        "kvtier_lookup_hits_blocks_total",
        "kvtier_lookup_misses_blocks_total",
        "kvtier_moved_bytes_total",
        "kvtier_jobs_in_flight",
        "kvtier_job_duration_seconds_bucket",
        "kvtier_tier_capacity_blocks",
        "kvtier_drive_write_rate_bytes_per_second",
        "kvtier_drive_write_budget_bytes_per_second",
        "kvtier_drive_projected_life_seconds",
        "kvtier_outages_total",
    ):
        assert needed in queried, needed
    assert "kvtier_job_duration_seconds_bucket" in live


def test_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and "datasource" in variables
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]

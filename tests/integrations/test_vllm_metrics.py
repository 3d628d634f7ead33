"""kvtier's metrics through vLLM 0.33's offloading metrics payload, unit by unit."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm_support import SPEC_MODULE, prometheus

from kvtier.integrations.vllm.metrics import MetricDeltas, metric_definitions
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.metrics.names import METRICS

EXTRA = {
    "spec_name": "TieredOffloadingSpec",
    "spec_module_path": SPEC_MODULE,
    "tiers": [{"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"}],
}


def test_every_metric_but_the_fallback_is_declared_by_its_exposed_name():
    declared = metric_definitions()
    assert len(declared) == len(METRICS) - 1
    for metric in METRICS:
        if metric.name == "kvtier_stat":
            continue
        name = metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name
        assert declared[name].labelnames == metric.labels


def test_increments_add_up_to_the_totals_and_every_job_lands_in_its_bucket():
    sink, registry = prometheus(EXTRA)
    deltas = MetricDeltas()
    histogram = LatencyHistogram()  # the bounds vLLM is told
    seconds = {("nvme", "load"): histogram}
    for observed, figures in (
        ((0.0005, 0.02), {"lookups": 10, "nvme.promoted_bytes": 4096, "nvme.blocks": 3}),
        ((), {"lookups": 10, "nvme.promoted_bytes": 4096, "nvme.blocks": 2}),  # nothing new
        ((0.001, 0.1, 12.0, 0.05), {"lookups": 25, "nvme.promoted_bytes": 12288, "nvme.blocks": 5}),
    ):
        for value in observed:
            histogram.observe(value)
        stats = OffloadingConnectorStats()
        deltas.add_to(stats, figures, seconds)
        sink.observe(stats.data)

    def get(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert get("kvtier_lookups_blocks_total") == 25
    assert get("kvtier_moved_bytes_total", tier="nvme", direction="load") == 12288
    assert get("kvtier_tier_blocks", tier="nvme") == 5  # a gauge: the last value
    load = {"tier": "nvme", "direction": "load"}
    assert get("kvtier_job_duration_seconds_count", **load) == histogram.count == 6
    for bound, cumulative in histogram.cumulative():  # 12 s only in +Inf, as kvtier has it
        le = "+Inf" if bound == float("inf") else repr(bound)
        assert get("kvtier_job_duration_seconds_bucket", le=le, **load) == cumulative
    assert get("kvtier_job_duration_seconds_bucket", le="10.0", **load) == 5


def test_every_counter_series_is_on_vllms_metrics_from_the_first_report():
    """vLLM creates a series when it is first sent: a counter still at 0 is sent once, so a
    healthy engine's /metrics has its failure counters (0, not "no data"), and the first
    failure is an increase of a scraped series, which an alert on its rate sees."""
    sink, registry = prometheus(EXTRA)
    deltas = MetricDeltas()
    for failed in (0, 0, 2):
        figures = {"lookups": 5, "nvme.failed_ENOSPC": failed, "nvme.demote_failures": failed}
        stats = OffloadingConnectorStats()
        deltas.add_to(stats, figures, {})
        sink.observe(stats.data)
        get = registry.get_sample_value
        enospc = {"engine": "0", "tier": "nvme", "reason": "ENOSPC"}
        assert get("kvtier_tier_failures_blocks_total", enospc) == failed
        store = {"engine": "0", "tier": "nvme", "direction": "store"}
        assert get("kvtier_failed_blocks_total", store) == failed
        assert get("kvtier_lookups_blocks_total", {"engine": "0"}) == 5  # sent once, not added again

"""kvtier's metrics on vLLM's own ``/metrics``, through 0.33's offloading metrics path.

vLLM 0.33 lets an ``OffloadingSpec`` declare metrics (``build_metric_definitions``: counters,
gauges, histograms with their label names) and its manager report them from ``get_stats()``,
which the connector calls every step: counters as increments since the last call, gauges as
values, histograms as the observations made since. vLLM adds its ``model_name`` and
``engine`` labels and serves them with its own. So the names here are kvtier's exporter's
(:mod:`kvtier.metrics.names`), and one dashboard reads either.

The job latency histograms keep bucket counts, not observations. Each new observation is
sent as its bucket's midpoint (the overflow bucket: twice its lower bound), which puts every count
in the right bucket, so quantiles are what kvtier's own endpoint gives; ``_sum`` is estimated
from those midpoints.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvtier.metrics.histogram import JOB_SECONDS_BUCKETS, LatencyHistogram
from kvtier.metrics.names import FALLBACK, JOB_SECONDS, METRICS, samples

__all__ = ["MetricDeltas", "metric_definitions", "vllm_name"]


def vllm_name(name: str) -> str:
    """The name to declare: a counter without ``_total`` (prometheus_client adds it back)."""
    return name.removesuffix("_total")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every kvtier metric but the fallback (``vllm:kv_offload_kvtier_stat`` carries every
    figure already), as vLLM's metadata."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for metric in METRICS:
        if metric is FALLBACK:
            continue
        if metric.kind == "counter":
            out[vllm_name(metric.name)] = OffloadingCounterMetadata(metric.help, metric.labels)
        elif metric.kind == "gauge":
            out[metric.name] = OffloadingGaugeMetadata(metric.help, metric.labels)
        else:
            out[metric.name] = OffloadingHistogramMetadata(metric.help, metric.labels, JOB_SECONDS_BUCKETS)
    return out


def _midpoints(bounds: tuple[float, ...]) -> list[float]:
    lower = (0.0, *bounds)
    # above the last bound: any value past it lands in +Inf only; twice the bound is a guess
    return [(low + high) / 2 for low, high in zip(lower, bounds)] + [2 * bounds[-1]]


class MetricDeltas:
    """What one manager reported so far, to send vLLM increments: counter totals and
    histogram bucket counts by series. Scheduler thread only (``get_stats``)."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, tuple[str, ...]], float] = {}
        self._buckets: dict[tuple[str, str], list[int]] = {}

    def add_to(
        self,
        stats: OffloadingConnectorStats,
        figures: Mapping[str, float],
        histograms: Mapping[tuple[str, str], LatencyHistogram],
    ) -> None:
        """Put what changed since the last call into ``stats``."""
        for sample in samples(figures):
            metric = sample.metric
            if metric is FALLBACK:
                continue
            if metric.kind == "gauge":
                stats.set_gauge(metric.name, sample.value, sample.labels)
                continue
            key = (metric.name, sample.labels)
            reported = self._totals.get(key)
            self._totals[key] = sample.value
            # A series is sent on its first report even at 0: vLLM creates it then, so
            # /metrics has every counter from the start (a dashboard shows 0, not "no data",
            # and an alert on its rate sees the first event); after that, increases only.
            if reported is None or sample.value > reported:
                stats.increase_counter(
                    vllm_name(metric.name), sample.value - (reported or 0.0), sample.labels
                )
        for series, histogram in histograms.items():
            counts = list(histogram.counts)
            before = self._buckets.get(series, [0] * len(counts))
            self._buckets[series] = counts
            for value, now, then in zip(_midpoints(histogram.bounds), counts, before):
                for _ in range(now - then):
                    stats.observe_histogram(JOB_SECONDS.name, value, series)

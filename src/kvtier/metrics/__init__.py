"""kvtier's metrics: ``stats()`` under Prometheus names, job latency histograms, a stats file.

* :mod:`kvtier.metrics.names`: the table mapping each ``stats()`` key to a metric;
* :mod:`kvtier.metrics.histogram`: the fixed-bucket histogram the manager records jobs in;
* :mod:`kvtier.metrics.exporter`: the prometheus_client collector and endpoint;
* :mod:`kvtier.metrics.report`: what a config's ``metrics`` section starts (endpoint, file).

Nothing here imports prometheus_client until an endpoint is asked for.
"""

from kvtier.metrics.exporter import MetricsEndpoint, StatsCollector, serve_metrics
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.metrics.report import StatsReporter, start_reporting

__all__ = [
    "LatencyHistogram",
    "MetricsEndpoint",
    "StatsCollector",
    "StatsReporter",
    "serve_metrics",
    "start_reporting",
]

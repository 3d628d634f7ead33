"""The Prometheus exporter of a manager's ``stats()`` (needs ``prometheus_client``).

Off by default: nothing here runs unless :func:`serve_metrics` is called (or a config's
``metrics.port`` asks for it). Every scrape reads ``manager.stats()`` and the job latency
histograms afresh, so the exporter keeps no state of its own; :mod:`kvtier.metrics.names`
says what each key becomes.

The scrape runs on prometheus_client's HTTP thread while the engine's scheduler thread may be
inside the manager; ``stats()`` only reads counters and container sizes, which is safe to do
concurrently in CPython (a figure may be one step old, never corrupt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvtier.errors import KvtierError
from kvtier.extras import install_hint
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.metrics.names import JOB_SECONDS, METRICS, samples

__all__ = ["MetricsEndpoint", "StatsCollector", "job_seconds_of", "serve_metrics"]

#: what a manager's ``job_seconds()`` returns: (tier, direction) -> histogram
JobSeconds = Mapping[tuple[str, str], LatencyHistogram]


def job_seconds_of(manager: Any) -> Callable[[], JobSeconds]:
    """``manager.job_seconds`` where it has one (a stack), else a callable giving none."""
    found = getattr(manager, "job_seconds", None)
    return found if callable(found) else dict


class StatsCollector:
    """A prometheus_client collector over ``stats()`` (a manager's, or any such callable) and,
    optionally, ``job_seconds()`` (the per-tier job latency histograms)."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, float]],
        job_seconds: Callable[[], JobSeconds] | None = None,
    ):
        self._stats = stats
        self._job_seconds = job_seconds or dict

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        families: dict[str, Any] = {}
        for sample in samples(self._stats()):
            metric = sample.metric
            family = families.get(metric.name)
            if family is None:
                family = kinds[metric.kind](metric.name, metric.help, labels=list(metric.labels))
                families[metric.name] = family
            family.add_metric(list(sample.labels), sample.value)
        histograms = self._job_seconds()
        if histograms:
            family = HistogramMetricFamily(
                JOB_SECONDS.name, JOB_SECONDS.help, labels=list(JOB_SECONDS.labels)
            )
            for (tier, direction), histogram in sorted(histograms.items()):
                buckets = [(_le(bound), count) for bound, count in histogram.cumulative()]
                family.add_metric([tier, direction], buckets, histogram.sum)
            families[JOB_SECONDS.name] = family
        order = {metric.name: i for i, metric in enumerate(METRICS)}
        yield from sorted(families.values(), key=lambda f: order.get(f.name + "_total", order.get(f.name, 0)))


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class MetricsEndpoint:
    """A running exporter: ``url`` to scrape, ``registry`` it serves, :meth:`close` to stop."""

    def __init__(self, registry: Any, server: Any, addr: str):
        self.registry = registry
        self._server = server
        #: the bound port (the one asked for, or the one the system chose for port 0)
        self.port: int = server.server_port
        self.url = f"http://{addr}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def serve_metrics(manager: Any, port: int, addr: str = "127.0.0.1") -> MetricsEndpoint:
    """Serve ``manager.stats()`` (and its job latencies) for Prometheus at
    ``http://addr:port/metrics``; port 0 takes a free one (``endpoint.port`` says which).

    Binds to loopback unless ``addr`` says otherwise. Raises :class:`KvtierError` when
    prometheus_client is missing (kvtier's ``prometheus`` extra) or the port cannot
    be bound.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise KvtierError(
            f"the Prometheus exporter needs prometheus_client: {install_hint('prometheus')}"
        ) from exc
    registry = CollectorRegistry()
    registry.register(StatsCollector(manager.stats, job_seconds_of(manager)))
    try:
        served = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise KvtierError(
            f"the metrics endpoint cannot listen on {addr}:{port} ({exc.strerror or exc}): "
            "choose a free port in metrics.port, or 0 for any"
        ) from exc
    if not isinstance(served, tuple):
        raise KvtierError(
            f"the metrics endpoint needs prometheus_client >= 0.20: {install_hint('prometheus')}"
        )
    return MetricsEndpoint(registry, served[0], addr)

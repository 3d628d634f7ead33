"""An optional Prometheus exporter of a manager's ``stats()`` (needs ``prometheus_client``).

Off by default: nothing here runs unless :func:`serve_metrics` is called. Every scrape reads
``manager.stats()`` afresh, so the exporter keeps no state of its own. Names follow
Prometheus habits: ``kvtier_<counter>`` with a ``tier`` label for the per-tier counters that
:class:`~kvtier.manager.stack.TierStackManager` reports as ``<tier>.<counter>``.

The scrape runs on prometheus_client's HTTP thread while the engine's scheduler thread may be
inside the manager; ``stats()`` only reads counters and container sizes, which is safe to do
concurrently in CPython (a figure may be one step old, never corrupt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvtier.errors import KvtierError

__all__ = ["StatsCollector", "serve_metrics"]


class StatsCollector:
    """A prometheus_client collector over ``stats()`` (a manager's, or any such callable)."""

    def __init__(self, stats: Callable[[], dict[str, int]], prefix: str = "kvtier"):
        self._stats = stats
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, GaugeMetricFamily] = {}
        for name, value in sorted(self._stats().items()):
            tier, _, counter = name.rpartition(".")
            metric = f"{self._prefix}_{counter}"
            family = families.get(metric)
            if family is None:
                family = GaugeMetricFamily(metric, f"kvtier manager stat {counter!r}", labels=["tier"])
                families[metric] = family
            family.add_metric([tier or "cpu"], float(value))
        yield from families.values()


def serve_metrics(manager: Any, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``manager.stats()`` for Prometheus at ``http://addr:port/metrics``.

    Returns the registry it serves. Binds to loopback unless ``addr`` says otherwise. Raises
    :class:`KvtierError` when prometheus_client is missing (``pip install 'kvtier[prometheus]'``).
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise KvtierError(
            "the Prometheus exporter needs prometheus_client: pip install 'kvtier[prometheus]'"
        ) from exc
    registry = CollectorRegistry()
    registry.register(StatsCollector(manager.stats))
    start_http_server(port, addr=addr, registry=registry)
    return registry

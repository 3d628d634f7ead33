"""What a config's ``metrics`` section starts for a running stack: a Prometheus endpoint, a
stats file, or both (:func:`start_reporting`), stopped by the manager's shutdown.

The stats file is ``stats()`` as JSON with the job latency histograms beside it, rewritten
every ``stats_interval_s`` by a daemon thread: written to a temporary file in the same folder
(mode 0600: the counters say what a tenant's engine does), then renamed over the old one, so
a reader (``kvtier stats PATH``) sees a whole snapshot or the previous one, never half.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from kvtier.atomic import replace_file
from kvtier.config import MetricsConfig
from kvtier.errors import KvtierError
from kvtier.metrics.exporter import MetricsEndpoint, job_seconds_of, serve_metrics

__all__ = ["STATS_FILE_VERSION", "StatsReporter", "snapshot", "start_reporting", "write_atomically"]

logger = logging.getLogger(__name__)

#: the ``version`` field of a stats file; a reader refuses others
STATS_FILE_VERSION = 1


def snapshot(manager: Any) -> dict[str, Any]:
    """The stats file's document for ``manager``: its ``stats()``, its job latency histograms
    (per tier and direction: bucket bounds, per-bucket counts with the overflow last, sum)."""
    histograms = {
        f"{tier}.{direction}": {"bounds": list(h.bounds), "counts": list(h.counts), "sum": h.sum}
        for (tier, direction), h in sorted(job_seconds_of(manager)().items())
    }
    return {
        "version": STATS_FILE_VERSION,
        "time": time.time(),
        "pid": os.getpid(),
        "stats": manager.stats(),
        "job_seconds": histograms,
    }


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` whole, readable by its user alone (not fsynced: the
    next snapshot follows within seconds)."""
    replace_file(path, text.encode(), durable=False)


class StatsReporter:
    """A running stack's reporting: the endpoint (``endpoint``, None without a port) and the
    stats file thread. :meth:`close` writes the last snapshot and stops both (idempotent)."""

    def __init__(self, manager: Any, config: MetricsConfig):
        self._manager = manager
        self._config = config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoint: MetricsEndpoint | None = None
        if config.stats_file is not None:
            self._write()  # a path that cannot be written fails the start, not a thread later
        if config.port is not None:
            self.endpoint = serve_metrics(manager, config.port, config.addr)
        if config.stats_file is not None:
            self._thread = threading.Thread(target=self._run, name="kvtier-stats-file", daemon=True)
            self._thread.start()

    def _write(self) -> None:
        path = self._config.stats_file
        assert path is not None
        try:
            write_atomically(path, json.dumps(snapshot(self._manager), sort_keys=True))
        except OSError as exc:
            raise KvtierError(
                f"metrics.stats_file {path!r} cannot be written ({exc.strerror or exc}): "
                "give a path in a folder this process may write"
            ) from exc

    def _run(self) -> None:
        while not self._stop.wait(self._config.stats_interval_s):
            try:
                self._write()
            except KvtierError as exc:  # a full disk must not stop the engine: try again later
                logger.warning("kvtier: %s", exc)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            try:
                self._write()  # the final figures (a stack's, once everything was saved)
            except KvtierError as exc:
                logger.warning("kvtier: %s", exc)
        if self.endpoint is not None:
            self.endpoint.close()


def start_reporting(manager: Any, config: MetricsConfig) -> StatsReporter | None:
    """Start what ``config`` asks for ``manager`` (None if nothing); the manager's shutdown
    stops it. Raises :class:`KvtierError` if the port or the file cannot be had."""
    if config.port is None and config.stats_file is None:
        return None
    reporter = StatsReporter(manager, config)
    manager.add_shutdown_hook(reporter.close)
    return reporter

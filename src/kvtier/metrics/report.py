"""What a config's ``metrics`` section starts for a running stack: a Prometheus endpoint (on a
port, a Unix socket, or both), a stats file, or both (:func:`start_reporting`), stopped by the
manager's shutdown.

The stats file is ``stats()`` as JSON with the job latency histograms beside it, rewritten
every ``stats_interval_s`` by a daemon thread: written to a temporary file in the same folder
(mode 0600: the counters say what a tenant's engine does), then renamed over the old one, so
a reader (``kvtier stats PATH``) sees a whole snapshot or the previous one, never half. The
rename replaces whatever the path names, so before the first write the path must be new or a
previous stats file, in a folder no one else may write (:func:`check_stats_file`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import threading
import time
from typing import Any

from kvtier.atomic import check_private_parent, replace_file
from kvtier.config import MetricsConfig
from kvtier.errors import ConfigError, KvtierError
from kvtier.metrics.exporter import MetricsEndpoint, check_unix_socket, job_seconds_of, serve_metrics

__all__ = [
    "MAX_STATS_FILE_BYTES",
    "STATS_FILE_VERSION",
    "StatsReporter",
    "check_reporting",
    "check_stats_file",
    "read_stats_document",
    "snapshot",
    "start_reporting",
    "write_atomically",
]

logger = logging.getLogger(__name__)

#: the ``version`` field of a stats file; a reader refuses others
STATS_FILE_VERSION = 1
#: the largest stats file read (a real one is a few KiB per tier)
MAX_STATS_FILE_BYTES = 16 << 20


def snapshot(manager: Any) -> dict[str, Any]:
    """The stats file's document for ``manager``: its ``stats()`` (finite numbers: JSON has no
    others), its job latency histograms (per tier and direction: bucket bounds, per-bucket
    counts with the overflow last, sum)."""
    histograms = {
        f"{tier}.{direction}": {"bounds": list(h.bounds), "counts": list(h.counts), "sum": h.sum}
        for (tier, direction), h in sorted(job_seconds_of(manager)().items())
    }
    stats = {k: v for k, v in manager.stats().items() if not isinstance(v, float) or math.isfinite(v)}
    return {
        "version": STATS_FILE_VERSION,
        "time": time.time(),
        "pid": os.getpid(),
        "stats": stats,
        "job_seconds": histograms,
    }


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` whole, readable by its user alone (not fsynced: the
    next snapshot follows within seconds)."""
    replace_file(path, text.encode(), durable=False)


def _not_a_number(constant: str) -> float:
    raise ValueError(f"it holds {constant}, which kvtier never writes")


def read_stats_document(path: str) -> dict[str, Any]:
    """The document of the stats file ``path`` (see :func:`snapshot`): a regular file (never
    a FIFO or device, which are not waited on nor read without end) of at most
    :data:`MAX_STATS_FILE_BYTES`, UTF-8 JSON of finite numbers, of this version. Raises
    :class:`KvtierError` saying which of these it is not."""
    try:
        # O_NONBLOCK: a FIFO's open would wait for a writer; it changes nothing for a file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KvtierError(
            f"{path}: no such file; give the metrics.stats_file path of a running kvtier, "
            "or its endpoint as http://HOST:PORT/metrics or its metrics.unix_socket"
        ) from None
    except OSError as exc:
        raise KvtierError(f"{path} cannot be read ({exc.strerror or exc})") from exc
    with open(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KvtierError(
                f"{path} is not a regular file (a FIFO, device or socket): not a kvtier stats file"
            )
        data = stream.read(MAX_STATS_FILE_BYTES + 1)
    if len(data) > MAX_STATS_FILE_BYTES:
        raise KvtierError(f"{path} is larger than {MAX_STATS_FILE_BYTES} bytes: not a kvtier stats file")
    try:
        document = json.loads(data.decode("utf-8"), parse_constant=_not_a_number)
    except UnicodeDecodeError:
        raise KvtierError(f"{path} is not UTF-8 text: not a kvtier stats file") from None
    except json.JSONDecodeError as exc:
        raise KvtierError(f"{path} is not JSON ({exc}): it is not a kvtier stats file") from None
    except ValueError as exc:
        raise KvtierError(f"{path} is a damaged kvtier stats file: {exc}") from None
    except RecursionError:
        raise KvtierError(f"{path} is JSON nested too deeply: not a kvtier stats file") from None
    if not isinstance(document, dict) or document.get("version") != STATS_FILE_VERSION:
        raise KvtierError(
            f"{path} is not a kvtier stats file (version {STATS_FILE_VERSION}): give the "
            "metrics.stats_file path of a running kvtier"
        )
    if not isinstance(document.get("stats"), dict):
        raise KvtierError(f"{path} has no stats: it is not a kvtier stats file")
    return document


def check_stats_file(path: str, field: str = "metrics.stats_file") -> None:
    """Refuse (a :class:`ConfigError` naming ``field``) a stats file path that writing would
    harm: one whose folder others may write (:func:`~kvtier.atomic.check_private_parent`),
    and an existing path that is not a previous stats file of this user's (a device, a FIFO,
    a symlink, another file: the rename would replace it). Changes nothing."""
    check_private_parent(path, field)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    what = None
    if not stat.S_ISREG(info.st_mode):
        what = "not a regular file (a symlink, device, FIFO, socket or folder)"
    elif info.st_uid != os.geteuid():
        what = f"owned by uid {info.st_uid}, not by this user"
    else:
        try:
            read_stats_document(path)
        except KvtierError as exc:
            what = f"not a previous kvtier stats file ({exc})"
    if what is not None:
        raise ConfigError(
            field,
            path,
            "a new path, or a stats file kvtier wrote before",
            f"{path} is {what}, and writing the stats would replace it: choose another path",
        )


def check_reporting(config: MetricsConfig) -> None:
    """What starting ``config`` would refuse about the paths it names (the stats file, the
    Unix socket), found without starting anything (``kvtier config check`` runs it)."""
    if config.stats_file is not None:
        check_stats_file(config.stats_file)
    if config.unix_socket is not None:
        check_unix_socket(config.unix_socket)


class StatsReporter:
    """A running stack's reporting: the endpoint (``endpoint``, None without a port or
    socket) and the stats file thread. :meth:`close` writes the last snapshot and stops both
    (idempotent)."""

    def __init__(self, manager: Any, config: MetricsConfig):
        self._manager = manager
        self._config = config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoint: MetricsEndpoint | None = None
        check_reporting(config)
        if config.stats_file is not None:
            self._write()  # a path that cannot be written fails the start, not a thread later
        if config.port is not None or config.unix_socket is not None:
            self.endpoint = serve_metrics(manager, config.port, config.addr, unix_socket=config.unix_socket)
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
    stops it. Raises :class:`KvtierError` if the port, the socket or the file cannot be had."""
    if config.port is None and config.unix_socket is None and config.stats_file is None:
        return None
    reporter = StatsReporter(manager, config)
    manager.add_shutdown_hook(reporter.close)
    return reporter

"""The Prometheus exporter of a manager's ``stats()`` (needs ``prometheus_client``).

Off by default: nothing here runs unless :func:`serve_metrics` is called (or a config's
``metrics.port`` or ``metrics.unix_socket`` asks for it). Every scrape reads ``manager.stats()`` and the job latency
histograms afresh, so the exporter keeps no state of its own; :mod:`kvtier.metrics.names`
says what each key becomes.

The scrape runs on the endpoint's thread (:class:`MetricsEndpoint`) while the engine's
scheduler thread may be inside the manager; ``stats()`` only reads counters and container
sizes, which is safe to do concurrently in CPython (a figure may be one step old, never
corrupt).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from typing import Any

from kvtier.atomic import check_private_parent
from kvtier.errors import ConfigError, KvtierError
from kvtier.extras import install_hint
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.metrics.names import JOB_SECONDS, METRICS, samples

__all__ = [
    "MAX_CONNECTIONS",
    "REQUEST_DEADLINE_S",
    "MetricsEndpoint",
    "StatsCollector",
    "check_unix_socket",
    "job_seconds_of",
    "serve_metrics",
]

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


#: connections the endpoint serves at once; one more is closed as soon as it is accepted
MAX_CONNECTIONS = 16
#: seconds a connection may take, from accept to the last byte of the answer
REQUEST_DEADLINE_S = 5.0
#: the most bytes of a request's line and headers (a scraper sends a few hundred)
MAX_REQUEST_BYTES = 8192
_MAX_UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes with the final NUL (Linux)


class MetricsEndpoint:
    """A running exporter on a TCP port, a Unix socket, or both: ``url`` (``None`` without a
    port) and ``unix_socket`` to scrape, ``registry`` it serves, :meth:`close` to stop.

    One thread runs an asyncio loop over every connection, whoever opens them: at most
    :data:`MAX_CONNECTIONS` at once (more are closed at accept), each closed
    :data:`REQUEST_DEADLINE_S` after it was accepted whatever it has sent, and a request
    head larger than :data:`MAX_REQUEST_BYTES` is dropped. So the endpoint costs one thread
    and at most ``MAX_CONNECTIONS`` + 5 descriptors however many local users connect; a user
    who holds every slot delays scrapes, never the engine. (Rejected: prometheus_client's
    ``start_http_server``, a thread and a descriptor per connection without a deadline, and a
    bounded thread pool, whose idle sockets would still wait in its queue.)
    """

    def __init__(self, registry: Any, listeners: list[socket.socket], unix_socket: str | None = None):
        self.registry = registry
        self._loop = asyncio.new_event_loop()
        self._open = 0
        self._unix_inode = os.lstat(unix_socket).st_ino if unix_socket is not None else None
        #: the bound port (the one asked for, or the one the system chose for port 0); None without one
        self.port: int | None = None
        self.url: str | None = None
        for listener in listeners:
            if listener.family != socket.AF_UNIX:
                host, self.port = listener.getsockname()[:2]
                self.url = f"http://{host}:{self.port}/metrics"
        #: the Unix socket's path (mode 0600), or None
        self.unix_socket = unix_socket
        self._servers = [
            self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=listener, limit=MAX_REQUEST_BYTES)
            )
            for listener in listeners
        ]
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-metrics", daemon=True)
        self._thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._open += 1
        try:
            await asyncio.wait_for(self._answer(reader, writer), REQUEST_DEADLINE_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.transport.abort()  # too slow, too large, or gone: no answer owed
        finally:
            self._open -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        head = await reader.readuntil(b"\r\n\r\n")
        method, target, version = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:3]
        path = target.split(b"?", 1)[0]
        body, kind = b"", "text/plain; charset=utf-8"
        if not version.startswith(b"HTTP/"):
            status = HTTPStatus.BAD_REQUEST
        elif method not in (b"GET", b"HEAD"):
            status = HTTPStatus.METHOD_NOT_ALLOWED
        elif path not in (b"/metrics", b"/"):
            status, body = HTTPStatus.NOT_FOUND, b"kvtier serves /metrics\n"
        else:
            status, body, kind = HTTPStatus.OK, generate_latest(self.registry), CONTENT_TYPE_LATEST
        writer.write(
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + (body if method != b"HEAD" else b"")
        )
        await writer.drain()

    def close(self) -> None:
        """Stop serving, free the port and remove the Unix socket (idempotent)."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            for server in self._servers:
                server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=REQUEST_DEADLINE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if self.unix_socket is not None:
            with contextlib.suppress(OSError):
                if os.lstat(self.unix_socket).st_ino == self._unix_inode:  # ours, not a successor's
                    os.unlink(self.unix_socket)


def serve_metrics(
    manager: Any, port: int | None = None, addr: str = "127.0.0.1", *, unix_socket: str | None = None
) -> MetricsEndpoint:
    """Serve ``manager.stats()`` (and its job latencies) for Prometheus at
    ``http://addr:port/metrics`` and/or on the Unix socket ``unix_socket`` (created mode 0600,
    removed by :meth:`MetricsEndpoint.close`); port 0 takes a free one (``endpoint.port``
    says which).

    Binds to loopback unless ``addr`` says otherwise. Raises :class:`KvtierError` when
    prometheus_client is missing (kvtier's ``prometheus`` extra), neither a port nor a socket
    is given, or one cannot be bound (a :class:`ConfigError` for a socket path that
    :func:`check_unix_socket` refuses).
    """
    try:
        from prometheus_client import CollectorRegistry
    except ImportError as exc:
        raise KvtierError(
            f"the Prometheus exporter needs prometheus_client: {install_hint('prometheus')}"
        ) from exc
    if port is None and unix_socket is None:
        raise KvtierError("serve_metrics needs a port or a unix_socket")
    registry = CollectorRegistry()
    registry.register(StatsCollector(manager.stats, job_seconds_of(manager)))
    listeners: list[socket.socket] = []
    try:
        if port is not None:
            try:
                listeners.append(socket.create_server((addr, port)))
            except OSError as exc:
                raise KvtierError(
                    f"the metrics endpoint cannot listen on {addr}:{port} ({exc.strerror or exc}): "
                    "choose a free port in metrics.port, or 0 for any"
                ) from exc
        if unix_socket is not None:
            listeners.append(_bind_unix(unix_socket))
        return MetricsEndpoint(registry, listeners, unix_socket)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise


def check_unix_socket(path: str, field: str = "metrics.unix_socket") -> None:
    """Refuse (a :class:`ConfigError` naming ``field``) a Unix socket path too long for one,
    whose folder others may write (they could put their own socket in its place), or at which
    something other than a socket of this user's lies. Changes nothing."""
    if len(os.fsencode(path)) > _MAX_UNIX_PATH_BYTES:
        raise ConfigError(
            field,
            path,
            f"a path of at most {_MAX_UNIX_PATH_BYTES} bytes (a Unix socket's limit)",
            "use a shorter path",
        )
    check_private_parent(path, field)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        raise ConfigError(
            field,
            path,
            "a new path, or a socket a previous engine of this user left",
            f"{path} is something else: remove it or choose another path",
        )


def _bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from the start (a stale one of this
    user's, left by a dead engine, is replaced; a live one is an error)."""
    check_unix_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.lexists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(path) == 0:
                    raise KvtierError(
                        f"metrics.unix_socket {path} is in use by another running engine: give each its own path"
                    )
            os.unlink(path)
        # Linux gives the socket file the mode of the socket's inode: 0600 before it exists,
        # so no other user can connect in between (the chmod after is for other systems)
        os.fchmod(listener.fileno(), 0o600)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen()
    except OSError as exc:
        listener.close()
        raise KvtierError(
            f"the metrics endpoint cannot listen on {path} ({exc.strerror or exc}): "
            "give metrics.unix_socket a path in a folder of your own"
        ) from exc
    except BaseException:
        listener.close()
        raise
    return listener

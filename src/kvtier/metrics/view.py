"""A running engine's counters, read back: from its metrics endpoint (Prometheus text, over
TCP or its Unix socket) or its stats file, into one summary per tier (what ``kvtier stats``
prints). Whatever answers is not trusted: one deadline, a size cap, no redirect followed, and
anything kvtier would not have written is an error naming it, never a traceback.

Both sources become the same series (the stats file through :func:`kvtier.metrics.names.samples`,
as the exporter does), so the summary is computed one way and agrees with the endpoint.
Labels the summary does not use (vLLM's ``engine``, ``model_name``) are summed over.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import re
import socket
import stat
import threading
import urllib.parse
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from kvtier.errors import KvtierError
from kvtier.metrics import names as n
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.metrics.report import read_stats_document

__all__ = ["Series", "endpoint_or_path", "parse_text", "read_series", "render", "summarize"]

#: one series: metric name (as exposed: ``_total``, ``_bucket`` ...), its labels, its value
Series = tuple[str, dict[str, str], float]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_text(text: str) -> list[Series]:
    """Prometheus's text exposition format as series; ValueError naming the first bad line."""
    out: list[Series] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"line {number} is not a Prometheus sample: {line[:80]!r}")
        labels: dict[str, str] = {}
        body = m.group(2) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise ValueError(f"line {number} has malformed labels: {line[:80]!r}")
            labels[lm.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            pos = lm.end()
        try:
            value = float(m.group(3))
        except ValueError:
            raise ValueError(f"line {number} has no number for its value: {line[:80]!r}") from None
        if m.group(1).endswith("_bucket"):
            try:
                float(labels["le"])
            except (KeyError, ValueError):
                raise ValueError(f"line {number} is a bucket without a number as le: {line[:80]!r}") from None
        out.append((m.group(1), labels, value))
    return out


def _snapshot_series(document: dict[str, Any], where: str) -> list[Series]:
    """A stats file's document (see :func:`kvtier.metrics.report.read_stats_document`) as
    series; KvtierError for a histogram that is not one (its counts must be one per bucket
    plus the overflow, whole and not negative, its bounds increasing)."""
    out: list[Series] = []
    for sample in n.samples(document["stats"]):
        metric = sample.metric
        out.append((metric.name, dict(zip(metric.labels, sample.labels)), sample.value))
    histograms = document.get("job_seconds") or {}
    if not isinstance(histograms, dict):
        raise KvtierError(f"{where} is a damaged kvtier stats file: job_seconds is not a mapping")
    for name, histogram in histograms.items():
        tier, _, direction = str(name).rpartition(".")
        try:
            bounds, counts, total = histogram["bounds"], histogram["counts"], histogram["sum"]
            if not (
                isinstance(bounds, list)
                and all(isinstance(b, int | float) and b > 0 for b in bounds)
                and bounds == sorted(set(bounds))
                and isinstance(counts, list)
                and len(counts) == len(bounds) + 1
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
                and isinstance(total, int | float)
                and total >= 0
            ):
                raise ValueError("its bounds, counts and sum do not make a histogram")
            h = LatencyHistogram(tuple(bounds))
        except (KeyError, TypeError, ValueError) as exc:
            raise KvtierError(
                f"{where} is a damaged kvtier stats file: job_seconds {name!r}: {exc}"
            ) from None
        h.counts = list(counts)
        labels = {"tier": tier, "direction": direction}
        for bound, count in h.cumulative():
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append((n.JOB_SECONDS.name + "_bucket", {**labels, "le": le}, float(count)))
        out.append((n.JOB_SECONDS.name + "_sum", labels, float(total)))
    return out


#: the most bytes of an endpoint's answer read (a real one is tens of KiB)
MAX_ANSWER_BYTES = 16 << 20


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket at ``path`` (an endpoint's ``metrics.unix_socket``)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _get(source: str, timeout_s: float) -> str:
    """The body of a GET of ``source`` (an http(s) URL, or a Unix socket's path), all of it
    within ``timeout_s`` however slowly the server sends it, at most :data:`MAX_ANSWER_BYTES`,
    and never from elsewhere: a redirect is an error, not followed."""
    connection: http.client.HTTPConnection
    if source.startswith(("http://", "https://")):
        try:
            parts = urllib.parse.urlsplit(source)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise KvtierError(f"{source} is not a URL ({exc}): write http://HOST:PORT/metrics") from None
        if not host:
            raise KvtierError(f"{source} names no host: write http://HOST:PORT/metrics")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(host, port, timeout=timeout_s)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    else:
        connection, target = _UnixHTTPConnection(source, timeout_s), "/metrics"
    # One deadline for the whole exchange: the socket's timeout bounds each read only, so a
    # server sending a byte a second would hold a plain read for ever; the timer cuts it.
    cut = threading.Event()
    opened: list[socket.socket] = []  # the response keeps reading it after the connection lets go

    def hang_up() -> None:
        cut.set()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, hang_up)
    timer.start()
    try:
        connection.connect()
        opened.append(connection.sock)
        if cut.is_set():
            hang_up()
        connection.request("GET", target, headers={"Accept": "text/plain"})
        response = connection.getresponse()
        if response.status != 200:
            where = response.getheader("Location")
            raise KvtierError(
                f"{source} answered {response.status} {response.reason}"
                + (
                    f" (a redirect to {where}: kvtier stats reads only the address it is given)"
                    if where
                    else ""
                )
                + ": give the engine's own metrics endpoint"
            )
        body = response.read(MAX_ANSWER_BYTES + 1)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if cut.is_set():
            raise KvtierError(f"{source} gave no whole answer within {timeout_s:g} s") from None
        raise KvtierError(
            f"cannot read {source} ({exc}): is the engine running with metrics.port or "
            "metrics.unix_socket set, and is this its address?"
        ) from None
    finally:
        timer.cancel()
        connection.close()
    if cut.is_set():  # the answer ended because the deadline cut it: not the whole of it
        raise KvtierError(f"{source} gave no whole answer within {timeout_s:g} s")
    if len(body) > MAX_ANSWER_BYTES:
        raise KvtierError(f"{source} answered more than {MAX_ANSWER_BYTES} bytes: not a kvtier endpoint")
    return body.decode("utf-8", "replace")


#: an endpoint written without its scheme: ``HOST:PORT`` or ``HOST:PORT/path`` (IPv6 in brackets)
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}(/\S*)?")


def endpoint_or_path(source: str) -> str:
    """``source`` as :func:`read_series` reads it: ``HOST:PORT`` (no such file here) is the
    endpoint ``http://HOST:PORT/metrics``, what people type after reading ``metrics.port``."""
    m = _HOST_PORT.fullmatch(source)
    if m is None or os.path.lexists(source):
        return source
    return f"http://{source}" + ("" if m.group(1) else "/metrics")


def read_series(source: str, timeout_s: float = 5.0) -> list[Series]:
    """The series of ``source``: an ``http(s)://`` metrics endpoint (or its ``HOST:PORT``),
    the path of its Unix socket, or a stats file's path.

    Raises :class:`KvtierError` saying what is wrong and what to give instead, for an
    endpoint that does not answer (in ``timeout_s``, all of it) or answers anything but
    kvtier's metrics, a missing file, or content that is neither.
    """
    source = endpoint_or_path(source)
    try:
        is_socket = stat.S_ISSOCK(os.stat(source).st_mode)
    except (OSError, ValueError):
        is_socket = False
    if is_socket or source.startswith(("http://", "https://")):
        text = _get(source, timeout_s)
        try:
            series = parse_text(text)
        except ValueError as exc:
            raise KvtierError(f"{source} did not answer Prometheus metrics: {exc}") from exc
        if not any(name.startswith("kvtier_") for name, _, _ in series):
            raise KvtierError(f"{source} serves no kvtier_ metrics: is it a kvtier engine's endpoint?")
    else:
        series = _snapshot_series(read_stats_document(source), source)
    problem = _inconsistency(series)
    if problem is not None:
        raise KvtierError(f"{source} does not hold kvtier's metrics as kvtier writes them: {problem}")
    return series


def _inconsistency(series: list[Series]) -> str | None:
    """What in kvtier's series no kvtier writes (a value not a finite number, a counter below
    zero, a histogram whose buckets shrink as their bound grows), or None."""
    buckets: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = defaultdict(list)
    for name, labels, value in series:
        if not name.startswith("kvtier_"):
            continue  # another exporter's series (vLLM's): summed over, never judged
        if not math.isfinite(value):
            return f"{name} is {value}"
        if value < 0 and name.endswith(("_total", "_bucket", "_sum", "_count")):
            return f"the counter {name} is {value:g}"
        if name.endswith("_bucket"):
            rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            buckets[name, rest].append((float(labels["le"]), value))
    for key, found in buckets.items():
        counts = [count for _, count in sorted(found)]
        if counts != sorted(counts):
            return f"the buckets of {key[0]} shrink as their bound grows"
    return None


def _sum(series: Iterable[Series], name: str, **match: str) -> dict[tuple[str, ...], float]:
    """Values of ``name`` summed by the label values named in ``match`` (``"*"``: any value,
    kept in the key; else that value only)."""
    keys = [label for label, want in match.items() if want == "*"]
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for metric, labels, value in series:
        if metric != name:
            continue
        if any(want != "*" and labels.get(label, "") != want for label, want in match.items()):
            continue
        out[tuple(labels.get(label, "") for label in keys)] += value
    return out


def _quantiles(series: list[Series], tier: str, direction: str) -> tuple[float | None, float | None]:
    buckets = _sum(series, n.JOB_SECONDS.name + "_bucket", tier=tier, direction=direction, le="*")
    if not buckets:
        return None, None
    finite = sorted((float(le), count) for (le,), count in buckets.items() if le != "+Inf")
    h = LatencyHistogram(tuple(bound for bound, _ in finite))
    below = 0.0
    for i, (_, cumulative) in enumerate(finite):
        h.counts[i] = int(cumulative - below)
        below = cumulative
    h.counts[-1] = int(buckets.get(("+Inf",), below) - below)
    return h.quantile(0.5), h.quantile(0.99)


def summarize(series: list[Series]) -> dict[str, Any]:
    """The summary ``kvtier stats`` prints: stack totals, misses by cause, and per tier its
    occupancy, hits, traffic, failures, latencies and, where counted, admission, budget and
    outages. Every figure is the series' value as exported (units: blocks, bytes, seconds)."""
    one = {name: sum(_sum(series, name).values()) for name in (n.LOOKUPS.name,)}
    hits = {tier: v for (tier,), v in _sum(series, n.HITS.name, tier="*").items()}
    causes = _sum(series, n.MISSES.name, tier="*", cause="*")
    misses = {cause: v for (tier, cause), v in sorted(causes.items()) if not tier}
    missed = sum(misses.values())
    # a block read up from below is a CPU hit too once looked up again (see names.HITS)
    found = hits.get(n.CPU_TIER, 0.0)
    tiers: dict[str, dict[str, Any]] = {}

    def put(metric: n.Metric, field: str, **match: str) -> None:
        for (tier,), value in _sum(series, metric.name, tier="*", **match).items():
            tiers.setdefault(tier, {})[field] = value

    put(n.TIER_BLOCKS, "blocks")
    put(n.TIER_CAPACITY, "capacity_blocks")
    put(n.HITS, "hits")
    put(n.EVICTIONS, "evictions")
    for direction in ("load", "store"):
        put(n.MOVED_BLOCKS, f"{direction}_blocks", direction=direction)
        put(n.MOVED_BYTES, f"{direction}_bytes", direction=direction)
        put(n.FAILED, f"{direction}_failed_blocks", direction=direction)
        put(n.JOBS_IN_FLIGHT, f"{direction}_jobs_in_flight", direction=direction)
    put(n.ADMISSION, "admitted_blocks", decision="admitted")
    put(n.ADMISSION, "refused_blocks", decision="refused")
    put(n.WRITE_RATE, "write_bytes_per_s")
    put(n.WRITE_BUDGET, "budget_bytes_per_s")
    put(n.LIFE, "projected_life_s")
    put(n.OUTAGES, "outages")
    put(n.DOWN, "down")
    for (tier, cause), value in causes.items():
        if tier:
            tiers.setdefault(tier, {}).setdefault("misses", {})[cause] = value
    for tier, figures in tiers.items():
        for direction in ("load", "store"):
            p50, p99 = _quantiles(series, tier, direction)
            if p50 is not None:
                figures[f"{direction}_p50_s"], figures[f"{direction}_p99_s"] = p50, p99
    ordered = dict(sorted(tiers.items(), key=lambda item: (item[0] != n.CPU_TIER, item[0])))
    foreign = {part: v for (part,), v in sorted(_sum(series, n.FOREIGN.name, part="*").items())}
    return {
        "lookups": one[n.LOOKUPS.name],
        "hit_blocks": found,
        "miss_blocks": missed,
        "hit_ratio": found / (found + missed) if found + missed else None,
        "misses": misses,
        "foreign": foreign,
        "tiers": ordered,
    }


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _either(figures: dict[str, Any], *names: str) -> float | None:
    """The sum of those of ``names`` present (None if none is: not counted, not zero)."""
    present = [figures[name] for name in names if name in figures]
    return sum(present) if present else None


#: what ``hit_ratio`` divides, printed beside it: not a replay's ratio, which counts the GPU's
#: own hits and every block of the trace
HIT_RATIO_MEANS = (
    "hit ratio = hits / (hits + misses): of the blocks the engine asked kvtier's tiers for "
    "after its GPU cache missed, the share a tier served; the GPU's own hits are not counted"
)


def render(summary: dict[str, Any]) -> str:
    """The summary as text: totals, then the tier table, then the misses by cause."""
    ratio = summary["hit_ratio"]
    lines = [
        f"lookups {summary['lookups']:.0f}   hits {summary['hit_blocks']:.0f}   "
        f"misses {summary['miss_blocks']:.0f}   hit ratio " + ("-" if ratio is None else f"{ratio:.1%}"),
        f"  ({HIT_RATIO_MEANS})",
        "",
    ]
    header = (
        "tier", "blocks", "capacity", "hits", "loaded", "stored", "load bytes", "store bytes",
        "failed", "evicted", "in flight", "load p50/p99 ms", "store p50/p99 ms",
    )  # fmt: skip
    rows = [header]
    for tier, f in summary["tiers"].items():
        failed = _either(f, "load_failed_blocks", "store_failed_blocks")
        in_flight = _either(f, "load_jobs_in_flight", "store_jobs_in_flight")
        rows.append(
            (
                tier,
                _count(f.get("blocks")),
                _count(f.get("capacity_blocks")),
                _count(f.get("hits")),
                _count(f.get("load_blocks")),
                _count(f.get("store_blocks")),
                _size(f.get("load_bytes")),
                _size(f.get("store_bytes")),
                _count(failed),
                _count(f.get("evictions")),
                _count(in_flight),
                f"{_ms(f.get('load_p50_s'))}/{_ms(f.get('load_p99_s'))}",
                f"{_ms(f.get('store_p50_s'))}/{_ms(f.get('store_p99_s'))}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
    lines += ["", "misses by cause:"]
    total = summary["miss_blocks"]
    for cause, value in sorted(summary["misses"].items(), key=lambda item: -item[1]):
        share = f"{value / total:.1%}" if total else "-"
        lines.append(f"  {cause:<14} {value:>10.0f}  {share:>6}")
    for part, value in summary["foreign"].items():
        lines.append(f"  foreign, {part} differs: {value:.0f}")
    extras = []
    for tier, f in summary["tiers"].items():
        if f.get("misses"):
            causes = ", ".join(f"{c} {v:.0f}" for c, v in sorted(f["misses"].items()))
            extras.append(f"  {tier}: misses it caused: {causes}")
        wear = []
        if "admitted_blocks" in f:
            wear.append(f"admitted {f['admitted_blocks']:.0f}, refused {f.get('refused_blocks', 0):.0f}")
        if "write_bytes_per_s" in f:
            budget = f.get("budget_bytes_per_s")
            wear.append(
                f"writes {_size(f['write_bytes_per_s'])}/s"
                + (f" of a {_size(budget)}/s budget" if budget is not None else "")
            )
        if "projected_life_s" in f:
            wear.append(f"projected life {f['projected_life_s'] / (365.25 * 86400):.1f} years")
        if wear:
            extras.append(f"  {tier}: " + "; ".join(wear))
        if "outages" in f:
            state = "DOWN" if f.get("down") else "up"
            extras.append(f"  {tier}: server {state}, {f['outages']:.0f} outages")
    if extras:
        lines += ["", "per tier:", *extras]
    return "\n".join(lines)

"""``admit: budget`` against ``admit: all`` and ``admit: reuse`` over a trace, in the trace's time.

Deterministic replays of the default stack (CPU tier over a disk tier):

1. ``all``: every block written — the baseline, whose bytes over the trace's span give the
   unthrottled write rate;
2. ``reuse``: ``min_reuse`` sightings before a write;
3. ``budget``: ``admit: budget`` at ``fraction`` of the unthrottled rate;
4. ``budget_matched``: ``admit: budget`` at the rate ``reuse`` wrote, for a comparison at the
   same bytes;
5. ``reuse_same_bytes``: ``admit: reuse`` at the fractional ``min_reuse`` (between 1 and
   ``min_reuse``) that writes what ``budget`` wrote, within :data:`SAME_BYTES` (found by
   regula falsi, at most :data:`SEARCH_RUNS` replays; the closest is reported): the same
   reuse filter a budget steers, held fixed, at the same bytes.

Budgets are given as ``drive_writes_per_day`` of a nominal drive (:data:`DRIVE_BYTES`), with
``budget_window_s`` of ``window_s``; bytes are those written while the trace ran (not the
shutdown's save). Each run also reports its busiest ``window_s`` of trace time
(``peak_bytes_per_s``), which a budget bounds (by its rate plus the bucket spread over the
span) and ``admit: reuse`` does not.

The replays are those of ``kvtier replay --deterministic --no-baseline`` (the same engine and
stack), run here so that the disk tier's bytes can be sampled after every request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvtier.config import load_config
from kvtier.replay.engine import ReplayEngine
from kvtier.replay.run import DEFAULT_BLOCK_BYTES, DEFAULT_GPU_BLOCKS, default_config
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, Request, bundled_trace_path, load_trace
from kvtier.tiers.disk.store import scratch_directory

__all__ = ["DRIVE_BYTES", "compare_write_budget"]

#: the nominal drive the budgets are written against (its size only scales drive_writes_per_day)
DRIVE_BYTES = 10**12
#: how close (a share of the budget run's bytes) ``reuse_same_bytes`` must write to stop looking
SAME_BYTES = 0.01
#: the most replays spent looking for ``reuse_same_bytes``'s ``min_reuse``
SEARCH_RUNS = 4
_BUDGET_FIGURES = (
    "budget_bytes_per_s",
    "write_bytes_per_s",
    "admit_threshold",
    "projected_life_years",
    "device_written_bytes",
)


def _run(
    requests: Sequence[Request], directory: Path, name: str, disk: dict[str, Any], span_s: float
) -> dict[str, Any]:
    from kvtier.spec import TieredOffloadingSpec

    (directory / name).mkdir()
    config: Any = default_config(str(directory / name), DEFAULT_BLOCK_BYTES)
    config["tiers"][1].update(disk)
    spec = TieredOffloadingSpec(
        load_config(config), gpu_block_size_tokens=TRACE_BLOCK_TOKENS, page_bytes=[DEFAULT_BLOCK_BYTES]
    )
    engine = ReplayEngine(spec, DEFAULT_GPU_BLOCKS, deterministic=True)
    manager: Any = engine.manager
    times: list[float] = []
    written: list[int] = []

    def sample(_: int) -> None:
        times.append(engine.trace_s or 0.0)
        written.append(manager.stats()["disk.demoted_bytes"])

    try:
        engine.run(requests, progress=sample, total=len(requests))
        stats = manager.stats()
    finally:
        engine.close()
    counts = engine.counts
    return {
        "run": name,
        "hit_ratio": sum(counts.hits.values()) / counts.block_refs,
        "disk_hits": counts.hits["disk"],
        "bytes_written": stats["disk.demoted_bytes"],
        "peak_bytes_per_s": _peak_rate(times, written, span_s),
        "mismatched_blocks": counts.mismatched_blocks,
        "verified_blocks": counts.verified_blocks,
        **{
            key: stats[f"disk.{key}"]
            for key in ("budget_bytes_per_s", "admit_threshold")
            if f"disk.{key}" in stats
        },
        "stats": {
            key: stats[f"disk.{key}"]
            for key in ("admitted_blocks", "refused_blocks", *_BUDGET_FIGURES)
            if f"disk.{key}" in stats
        },
    }


def _peak_rate(times: Sequence[float], written: Sequence[int], span_s: float) -> float:
    """The most bytes per second written over any ``span_s`` of trace time (samples of the
    cumulative bytes ``written`` at ``times``, after each request)."""
    peak = 0.0
    for i, now in enumerate(times):
        if now - times[0] < span_s:
            continue
        j = bisect.bisect_right(times, now - span_s) - 1  # the last sample at or before the span's start
        peak = max(peak, (written[i] - written[j]) / (now - times[j]))
    return peak


def _same_bytes(
    run: Callable[[float], dict[str, Any]], target: int, low: dict[str, Any], high: dict[str, Any]
) -> dict[str, Any]:
    """The run of ``run(min_reuse)`` writing closest to ``target`` bytes, looking between the
    runs ``low`` and ``high`` (a lower and a higher ``min_reuse``, already run): regula falsi
    (Illinois: an end kept twice counts half, so a curved bytes-by-bar converges from both
    sides) while they bracket ``target``; the closest of every run seen, endpoints included,
    labelled as ``run``'s. A target outside the bracket gets the nearer endpoint: no bar
    outside it is tried (below 1 there is none)."""
    seen = [low, high]
    if high["bytes_written"] < target < low["bytes_written"]:
        (low_bar, low_off), (high_bar, high_off) = (
            (run_["min_reuse"], run_["bytes_written"] - target) for run_ in (low, high)
        )
        kept = ""
        for _ in range(SEARCH_RUNS):
            bar = round(low_bar + low_off * (high_bar - low_bar) / (low_off - high_off), 4)
            found = run(bar)
            seen.append(found)
            off = found["bytes_written"] - target
            if abs(off) <= SAME_BYTES * target:
                break
            if off > 0:
                low_bar, low_off = bar, off
                high_off /= 2 if kept == "high" else 1
                kept = "high"
            else:
                high_bar, high_off = bar, off
                low_off /= 2 if kept == "low" else 1
                kept = "low"
    best = min(seen, key=lambda r: abs(r["bytes_written"] - target))
    return {**best, "run": "reuse_same_bytes"}


def _budget(bytes_per_s: float, window_s: float) -> dict[str, Any]:
    return {
        "admit": "budget",
        "drive_writes_per_day": bytes_per_s * 86400 / DRIVE_BYTES,
        "drive_bytes": DRIVE_BYTES,
        "budget_window_s": window_s,
    }


def compare_write_budget(
    trace: str | None = None,
    *,
    limit: int | None = None,
    fraction: float = 0.5,
    min_reuse: int = 2,
    window_s: float = 300.0,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """The runs above; a record with each run's figures, the budget runs' written bytes as a
    share of their budget (``*_share``: 1.0 is the budget exactly), and the budget's hit ratio
    less that of ``reuse_same_bytes`` (``hit_ratio_over_same_bytes``)."""
    trace = trace or str(bundled_trace_path())
    requests = [r for r in load_trace(trace, limit) if len(r.hash_ids) <= DEFAULT_GPU_BLOCKS]
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    if span_s <= 0:
        raise ValueError(f"the trace's requests span no time ({trace}): a budget per second needs some")
    with scratch_directory("budget-") as folder:
        directory = Path(folder)
        full = _run(requests, directory, "all", {"admit": "all"}, window_s)
        reuse = _run(requests, directory, "reuse", {"admit": "reuse", "min_reuse": min_reuse}, window_s)
        half_rate = fraction * full["bytes_written"] / span_s
        half = _run(requests, directory, "budget", _budget(half_rate, window_s), window_s)
        matched_rate = reuse["bytes_written"] / span_s
        matched = _run(requests, directory, "budget_matched", _budget(matched_rate, window_s), window_s)

        def fixed(bar: float) -> dict[str, Any]:
            name = f"reuse_{bar:g}".replace(".", "_")
            found = _run(requests, directory, name, {"admit": "reuse", "min_reuse": bar}, window_s)
            return {**found, "min_reuse": bar}

        same = _same_bytes(
            fixed,
            half["bytes_written"],
            {**full, "min_reuse": 1},
            {**reuse, "min_reuse": min_reuse},
        )
    record = {
        "trace": Path(trace).name,
        "requests": len(requests),
        "span_s": span_s,
        "fraction": fraction,
        "min_reuse": min_reuse,
        "window_s": window_s,
        "runs": [full, reuse, half, matched, same],
        "budget_share": half["bytes_written"] / (half_rate * span_s),
        "budget_matched_share": matched["bytes_written"] / (matched_rate * span_s),
        "same_bytes_share": same["bytes_written"] / half["bytes_written"],
        "hit_ratio_over_same_bytes": half["hit_ratio"] - same["hit_ratio"],
    }
    if out is not None:
        from kvtier.bench.report import print_table

        bars = {"reuse": min_reuse, "reuse_same_bytes": same["min_reuse"]}
        print_table(
            [
                {**run, "min_reuse": bars.get(run["run"]), "hit_ratio": f"{run['hit_ratio']:.4f}"}
                for run in record["runs"]
            ],
            [
                "run",
                "min_reuse",
                "bytes_written",
                "hit_ratio",
                "disk_hits",
                "budget_bytes_per_s",
                "peak_bytes_per_s",
                "admit_threshold",
            ],
            out,
        )
    return record

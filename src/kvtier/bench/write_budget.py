"""``admit: budget`` against ``admit: all`` and ``admit: reuse`` over a trace, in the trace's time.

Four deterministic replays of the default stack (CPU tier over a disk tier):

1. ``all``: every block written — the baseline, whose bytes over the trace's span give the
   unthrottled write rate;
2. ``reuse``: ``min_reuse`` sightings before a write;
3. ``budget``: ``admit: budget`` at ``fraction`` of the unthrottled rate;
4. ``budget_matched``: ``admit: budget`` at the rate ``reuse`` wrote, for a comparison at the
   same bytes.

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
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvtier.config import load_config
from kvtier.replay.engine import ReplayEngine
from kvtier.replay.run import DEFAULT_BLOCK_BYTES, DEFAULT_GPU_BLOCKS, default_config
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, Request, bundled_trace_path, load_trace

__all__ = ["DRIVE_BYTES", "compare_write_budget"]

#: the nominal drive the budgets are written against (its size only scales drive_writes_per_day)
DRIVE_BYTES = 10**12
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
    """The four runs above; a record with each run's figures and the budget runs' written
    bytes as a share of their budget (``*_share``: 1.0 is the budget exactly)."""
    trace = trace or str(bundled_trace_path())
    requests = [r for r in load_trace(trace, limit) if len(r.hash_ids) <= DEFAULT_GPU_BLOCKS]
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    if span_s <= 0:
        raise ValueError(f"the trace's requests span no time ({trace}): a budget per second needs some")
    with tempfile.TemporaryDirectory(prefix="kvtier-budget-", dir=Path.cwd()) as folder:
        directory = Path(folder)
        full = _run(requests, directory, "all", {"admit": "all"}, window_s)
        reuse = _run(requests, directory, "reuse", {"admit": "reuse", "min_reuse": min_reuse}, window_s)
        half_rate = fraction * full["bytes_written"] / span_s
        half = _run(requests, directory, "budget", _budget(half_rate, window_s), window_s)
        matched_rate = reuse["bytes_written"] / span_s
        matched = _run(requests, directory, "budget_matched", _budget(matched_rate, window_s), window_s)
    record = {
        "trace": Path(trace).name,
        "requests": len(requests),
        "span_s": span_s,
        "fraction": fraction,
        "min_reuse": min_reuse,
        "window_s": window_s,
        "runs": [full, reuse, half, matched],
        "budget_share": half["bytes_written"] / (half_rate * span_s),
        "budget_matched_share": matched["bytes_written"] / (matched_rate * span_s),
    }
    if out is not None:
        from kvtier.bench.report import print_table

        print_table(
            [{k: v for k, v in run.items() if k != "stats"} for run in record["runs"]],
            [
                "run",
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

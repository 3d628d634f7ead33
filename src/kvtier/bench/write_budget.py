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
shutdown's save).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, TextIO

from kvtier.replay.run import DEFAULT_BLOCK_BYTES, default_config, replay
from kvtier.replay.trace import bundled_trace_path, load_trace

__all__ = ["DRIVE_BYTES", "compare_write_budget"]

#: the nominal drive the budgets are written against (its size only scales drive_writes_per_day)
DRIVE_BYTES = 10**12


def _run(trace: str, limit: int | None, directory: Path, name: str, disk: dict[str, Any]) -> dict[str, Any]:
    (directory / name).mkdir()
    config: Any = default_config(str(directory / name), DEFAULT_BLOCK_BYTES)
    config["tiers"][1].update(disk)
    with open(Path(directory) / f"{name}.out", "w") as out:
        record = replay(
            trace, config, limit=limit, baseline=False, progress=False, deterministic=True, out=out
        )
    tier = record["admission"]["disk"]
    return {
        "run": name,
        "hit_ratio": record["hit_ratio"],
        "disk_hits": record["hits"]["disk"],
        "bytes_written": record["bytes_written"]["disk"],
        "mismatched_blocks": record["mismatched_blocks"],
        **{key: tier[key] for key in ("budget_bytes_per_s", "admit_threshold") if key in tier},
        "stats": tier,
    }


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
    requests = load_trace(trace, limit)
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    if span_s <= 0:
        raise ValueError(f"the trace's requests span no time ({trace}): a budget per second needs some")
    with tempfile.TemporaryDirectory(prefix="kvtier-budget-", dir=Path.cwd()) as folder:
        directory = Path(folder)
        full = _run(trace, limit, directory, "all", {"admit": "all"})
        reuse = _run(trace, limit, directory, "reuse", {"admit": "reuse", "min_reuse": min_reuse})
        half_rate = fraction * full["bytes_written"] / span_s
        half = _run(trace, limit, directory, "budget", _budget(half_rate, window_s))
        matched_rate = reuse["bytes_written"] / span_s
        matched = _run(trace, limit, directory, "budget_matched", _budget(matched_rate, window_s))
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
            ["run", "bytes_written", "hit_ratio", "disk_hits", "budget_bytes_per_s", "admit_threshold"],
            out,
        )
    return record

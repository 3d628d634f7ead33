"""``kvtier bench cascade``: what a lower tier's ``receives`` does to writes, hits and time.

A lower tier either mirrors the CPU tier (``receives: saved``: every block saved out of it,
as the write policy says) or takes its victims (``receives: evicted``: only blocks leaving
it that no mirror above keeps). This replays one trace, in one run, through three stacks
built the way a user would write them, each in a fresh directory:

* ``mirror``: CPU + disk, ``receives: saved`` (what ``kvtier replay`` runs) — the baseline;
* ``victim``: the same disk, ``receives: evicted``;
* ``nvme+bulk``: CPU + a small disk mirror admitting only reused blocks (``admit: reuse``)
  + a large victim disk (docs/managers.md#the-cascade).

Bytes written are counted during the run and at ``shutdown`` (which saves the blocks only the
CPU tier holds: a victim tier gets them all then, a mirror only those not saved yet);
``total_bytes_written`` is both, and it is what compares: how a run splits between the two
depends on when the tiers' jobs finish, so it moves from run to run, while the hit ratio and
the total do not (each distinct block is written once, whichever way, while the disk holds
the working set). Times are one run each.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO, cast

import yaml

from kvtier.bench.report import print_table
from kvtier.replay.run import DEFAULT_BLOCK_BYTES, DEFAULT_DISK_BLOCKS, default_config, replay
from kvtier.tiers.disk.store import scratch_directory

__all__ = ["STACKS", "run"]

#: the stacks compared, the baseline first
STACKS = ("mirror", "victim", "nvme+bulk")
#: the small mirror of ``nvme+bulk``, as a share of the big disk (a fast drive in front of a
#: large slow one)
NVME_SHARE = 0.25


def _config(name: str, directory: Path, block_bytes: int) -> dict[str, Any]:
    config = default_config(str(directory), block_bytes, "lmdb")
    disk = config["tiers"][1]
    if name == "victim":
        disk["receives"] = "evicted"
    elif name == "nvme+bulk":
        nvme = dict(disk, name="nvme", path=str(directory / "nvme"), admit="reuse", min_reuse=2)
        nvme["capacity"] = int(disk["capacity"] * NVME_SHARE)
        bulk = dict(disk, name="bulk", kind="files", path=str(directory / "bulk"), receives="evicted")
        config["tiers"][1:] = [nvme, bulk]
    return config


def run(
    *,
    trace: str | None = None,
    limit: int | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    gpu_blocks: int = 2000,
    progress: bool = False,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` (default: the bundled one) through each of :data:`STACKS`; print the
    table; the JSON record."""
    out = out or sys.stdout
    results: dict[str, dict[str, Any]] = {}
    ceiling = block_refs = requests = None  # the trace's, the same for every stack
    for name in STACKS:
        with scratch_directory("cascade-") as directory:
            config = _config(name, Path(directory), block_bytes)
            record = replay(
                trace,
                yaml.safe_dump(config),
                gpu_blocks=gpu_blocks,
                block_bytes=block_bytes,
                limit=limit,
                baseline=False,
                progress=progress,
                out=cast(TextIO, _Discard()),
            )
        lower = [tier["name"] for tier in config["tiers"][1:]]
        results[name] = {
            "hit_ratio": record["hit_ratio"],
            "hits": record["hits"],
            "bytes_written": {tier: record["bytes_written"][tier] for tier in lower},
            "bytes_read": {tier: record["bytes_read"][tier] for tier in lower},
            "lower_bytes_written": sum(record["bytes_written"][tier] for tier in lower),
            "lower_bytes_read": sum(record["bytes_read"][tier] for tier in lower),
            "shutdown_bytes_written": record["shutdown_bytes_written"],
            "total_bytes_written": sum(record["bytes_written"][tier] for tier in lower)
            + sum(record["shutdown_bytes_written"].values()),
            "admission": record["admission"],
            "mismatched_blocks": record["mismatched_blocks"],
            "elapsed_s": record["elapsed_s"],
            "shutdown_s": record["shutdown_s"],
            "blocks_per_s": record["blocks_per_s"],
        }
        ceiling, block_refs, requests = record["ceiling_hit_ratio"], record["block_refs"], record["requests"]
    base = results[STACKS[0]]
    rows = []
    for name, figures in results.items():
        written = figures["lower_bytes_written"]
        figures["written_vs_mirror"] = (
            written / base["lower_bytes_written"] if base["lower_bytes_written"] else None
        )
        total = figures["total_bytes_written"]
        figures["total_vs_mirror"] = (
            total / base["total_bytes_written"] if base["total_bytes_written"] else None
        )
        figures["hit_ratio_vs_mirror"] = figures["hit_ratio"] - base["hit_ratio"]
        rows.append(
            {
                "stack": name,
                "hit_ratio": figures["hit_ratio"],
                "written_MB": total / 1e6,
                "vs_mirror": figures["total_vs_mirror"],
                "in_run_MB": written / 1e6,
                "at_shutdown_MB": (total - written) / 1e6,
                "read_back_MB": figures["lower_bytes_read"] / 1e6,
                "elapsed_s": figures["elapsed_s"],
                "shutdown_s": figures["shutdown_s"],
            }
        )
    result = {
        "bench": "cascade",
        "baseline": STACKS[0],
        "requests": requests,
        "block_refs": block_refs,
        "ceiling_hit_ratio": ceiling,
        "block_bytes": block_bytes,
        "disk_blocks": DEFAULT_DISK_BLOCKS,
        "stacks": results,
    }
    print(
        f"kvtier bench cascade: {requests} requests, {block_refs} block refs, one run per stack "
        f"(bytes written below: in all, during the run, and by the shutdown's save)",
        file=out,
    )
    print_table(
        rows,
        [
            "stack",
            "hit_ratio",
            "written_MB",
            "vs_mirror",
            "in_run_MB",
            "at_shutdown_MB",
            "read_back_MB",
            "elapsed_s",
            "shutdown_s",
        ],
        out,
    )
    return result


class _Discard:
    """A text sink: each replay's own report is not this benchmark's."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

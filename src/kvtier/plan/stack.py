"""``kvtier plan --write-config``: the planner's advice as a kvtier YAML stack.

A CPU tier of the advised blocks above an LMDB disk tier of the advised blocks, each sized in
the bytes its kind spends per block: a CPU row is the block rounded up to whole 4 KiB pages,
and a disk tier's ``capacity`` also counts each block's header page. The file is what
``kvtier config check`` reads; the disk tier's ``path`` is a default to edit.
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.atomic import replace_file
from kvtier.config.units import format_size
from kvtier.errors import ConfigError
from kvtier.replay.trace import TRACE_BLOCK_TOKENS
from kvtier.tiers.cpu.region import ROW_ALIGNMENT, row_stride_for
from kvtier.tiers.disk.format import HEADER_BYTES, on_disk_block_bytes

__all__ = ["DISK_PATH", "PER_BLOCK", "check_writable", "stack_yaml", "tier_capacities", "write_stack"]

#: the disk tier's folder in a written stack (as in examples/cpu-lmdb.yaml): edit it to a disk of yours
DISK_PATH = "~/.cache/kvtier/lmdb"
#: what each tier's capacity counts per block beyond the payload: said where a user sizes it
PER_BLOCK = {
    "cpu": f"each block in whole {format_size(ROW_ALIGNMENT)} pages",
    "disk": f"a disk tier's capacity counts each block's {format_size(HEADER_BYTES)} header too",
}


def tier_capacities(
    block_bytes: int, cpu_blocks: int | None, disk_blocks: int | None
) -> dict[str, int | None]:
    """The ``capacity`` bytes a CPU tier and a disk tier need to hold those blocks (None: no advice)."""
    return {
        "cpu_capacity_bytes": None if cpu_blocks is None else cpu_blocks * row_stride_for(block_bytes),
        "disk_capacity_bytes": None
        if disk_blocks is None
        else disk_blocks * on_disk_block_bytes(block_bytes),
    }


def check_writable(path: str) -> None:
    """Refuse, before a long simulation, a ``--write-config`` path whose folder is missing or
    not writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise ConfigError(
            "--write-config",
            path,
            "a file in a folder you may write",
            f"create {folder} or give another path",
        )


def stack_yaml(record: dict[str, Any], block_note: str) -> str:
    """The advised stack of a :func:`~kvtier.plan.run.plan` record, as commented YAML; a
    :class:`ConfigError` if a tier's target was not reached."""
    advice = record["recommend"]
    if advice["cpu_blocks"] is None or advice["disk_blocks"] is None:
        raise ConfigError(
            "--write-config",
            "not reached",
            "a plan whose simulated sizes reach --cpu-target and --target",
            "simulate larger sizes: --capacities up to the trace's distinct blocks",
        )
    size = format_size(record["block_bytes"])
    policy = dict(zip(record["capacities"], record["best_policy"]))
    return f"""\
# kvtier plan's advice for {_comment(record["trace"])}: the smallest simulated sizes whose best policy
# reaches {record["cpu_target"]:.0%} (CPU tier) and {record["target"]:.0%} (disk tier) of the trace's {record["ceiling"]} hit-ratio ceiling.
# Check it with: kvtier config check FILE
block_size_tokens: {TRACE_BLOCK_TOKENS}   # a trace block; {size} each ({_comment(block_note)})
tiers:
  - name: cpu
    kind: cpu
    capacity: {advice["cpu_capacity_bytes"]}   # {format_size(advice["cpu_capacity_bytes"])}: {advice["cpu_blocks"]} blocks, {PER_BLOCK["cpu"]}
    eviction: {policy[advice["cpu_blocks"]]}
  - name: disk
    kind: lmdb
    path: {DISK_PATH}   # a folder of yours, ideally on local NVMe
    capacity: {advice["disk_capacity_bytes"]}   # {format_size(advice["disk_capacity_bytes"])}: {advice["disk_blocks"]} blocks; {PER_BLOCK["disk"]}
    eviction: {policy[advice["disk_blocks"]]}
"""


def _comment(text: str) -> str:
    """``text`` on one line: a path or a model's name never ends a YAML comment early."""
    return " ".join(text.split())


def write_stack(record: dict[str, Any], block_note: str, path: str) -> None:
    """Write :func:`stack_yaml` to ``path`` (mode 0600, replaced whole)."""
    text = stack_yaml(record, block_note)
    try:
        replace_file(path, text.encode(), durable=False)
    except OSError as exc:
        raise ConfigError(
            "--write-config", path, "a file path you may write", f"give another path ({exc.strerror or exc})"
        ) from None

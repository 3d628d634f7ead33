"""Failed-store marks shared between the workers and the scheduler side, one byte per CPU row.

Why: vLLM 0.33's connector has no way to carry a failed transfer from a worker to the
scheduler. Its workers assert that every job succeeded, and its scheduler completes a job once
``world_size`` workers acknowledged it, always with ``success=True``. Under tensor or pipeline
parallelism a store that failed on one rank would then publish a row whose shard of that rank
holds stale bytes. So a worker whose store failed marks the job's rows here *before* it
acknowledges the job, and the manager reads (and clears) the marks of a store's rows when vLLM
completes it, completing the marked blocks with ``success=False`` instead: the block is
dropped, never served. The acknowledgement crosses processes through vLLM's IPC after the mark
is written, so the scheduler always sees it. (Rejected: withholding the acknowledgement,
which leaves the job, its request and its blocks pending forever.)

The marks are a :class:`~kvtier.tiers.cpu.region.SharedRegion` of one row, one byte per CPU
row, at ``<region path>.failed``: created by the scheduler side with the CPU tier, attached by
each worker. A mark is only ever set by workers and cleared by the scheduler side, for rows
whose store is in flight, so no lock is needed: a byte store is atomic, and the two sides
never write one byte for the same job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvtier.errors import KvtierError
from kvtier.tiers.cpu.region import SharedRegion

__all__ = ["FailedRowMarks", "marks_path"]

_POLL_S = 0.05


def marks_path(region_path: str) -> str:
    """Where the marks of the CPU region at ``region_path`` live."""
    return region_path + ".failed"


class FailedRowMarks:
    """One byte per CPU row: nonzero while a store into that row failed on some worker."""

    def __init__(self, region: SharedRegion):
        self._region = region
        self._marks = region.rows[0, : region.row_bytes]

    @classmethod
    def create(cls, region_path: str, num_rows: int) -> FailedRowMarks:
        """Scheduler side, with the CPU tier: all rows unmarked. Removed by :meth:`close`."""
        return cls(SharedRegion.create(1, num_rows, path=marks_path(region_path)))

    @classmethod
    def attach(cls, region_path: str, timeout_s: float = 10.0) -> FailedRowMarks:
        """Worker side: the marks the scheduler side created, waiting up to ``timeout_s``
        for them (they are created just after the CPU region). Raises
        :class:`~kvtier.errors.KvtierError` naming the path after that."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(SharedRegion.attach(marks_path(region_path)))
            except KvtierError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(_POLL_S)

    @property
    def num_rows(self) -> int:
        return len(self._marks)

    def mark(self, rows: Sequence[int] | np.ndarray) -> None:
        """Worker: the store into ``rows`` failed here. Call before acknowledging the job."""
        self._marks[np.asarray(rows, dtype=np.int64)] = 1

    def take(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Scheduler side: which of ``rows`` are marked (a bool per row); clears them."""
        index = np.asarray(rows, dtype=np.int64)
        marked = self._marks[index] != 0
        self._marks[index] = 0
        return marked

    def clear(self) -> None:
        """Scheduler side: forget every mark (after a cache reset, once the workers flushed)."""
        self._marks[:] = 0

    def close(self) -> None:
        """Unmap; the creator also removes the file. Idempotent."""
        # our view first: a live view would keep the mapping until garbage collection
        self._marks = np.zeros(0, dtype=np.uint8)
        self._region.close()

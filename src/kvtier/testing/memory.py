"""The in-memory tiers: the smallest working examples, the test doubles, the templates.

- :class:`MemoryBackend` / :class:`NullBackend`: a first tier (a ``Backend``) whose rows live in
  this process's memory. A SlotBackend needs a spec type for its medium and a place for its
  rows, nothing else; the manager and the policy do the rest.
- :class:`MemoryTier`: a lower tier keeping the whole :class:`~kvtier.tiers.base.SecondaryTier`
  contract: the bookkeeping (reserved-while-written keys, eviction that spares keys being
  read, events) is :class:`~kvtier.tiers.indexed.IndexedTier`'s, the medium a dict with verified
  loads — none of a disk's machinery. It runs jobs when asked rather than on
  threads, so tests decide exactly when a job finishes. Failure injection
  (:meth:`MemoryTier.fail_next`, :meth:`MemoryTier.corrupt`) drives the manager's error paths.

Copy this file to start a new tier.
"""

from __future__ import annotations

import errno
from collections import deque

import numpy as np
import xxhash

from kvtier.base import OffloadKey
from kvtier.mediums import MemoryLoadStoreSpec
from kvtier.policies.lru import LRUPolicy
from kvtier.tiers.indexed import IndexedTier
from kvtier.tiers.jobs import CheckReport, Failure, TierJobResult, TierWork
from kvtier.tiers.cpu.slots import SlotBackend

__all__ = ["MemoryBackend", "MemoryTier", "NullBackend"]


class MemoryBackend(SlotBackend):
    """``num_blocks`` rows of ``block_bytes`` in a private numpy array (not shared, not pinned)."""

    spec_type = MemoryLoadStoreSpec

    def __init__(self, num_blocks: int, block_bytes: int):
        super().__init__(block_bytes, num_blocks)
        self.rows = np.zeros((num_blocks, block_bytes), dtype=np.uint8)


class NullBackend(MemoryBackend):
    """A tier that holds nothing: every store is refused (``prepare_store`` returns ``None``)."""

    def __init__(self, block_bytes: int = 0):
        super().__init__(0, block_bytes)


class MemoryTier(IndexedTier):
    """Up to ``capacity_blocks`` blocks as ``bytes``, LRU-evicted, checksummed with xxh3-64.

    ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view that jobs copy from and
    into. The scheduler-side bookkeeping (reservations, readers, eviction, events, counters)
    is :class:`~kvtier.tiers.indexed.IndexedTier`'s; this class is only the medium: a dict.
    Jobs queue on submission and run at the next :meth:`get_finished_jobs` (or
    :meth:`drain_jobs`), unless :attr:`paused` holds them back.
    """

    medium = "MEMORY_STORE"

    def __init__(self, name: str, rows: np.ndarray, capacity_blocks: int):
        super().__init__(name, rows.shape[1], capacity_blocks, LRUPolicy(capacity_blocks))
        self._rows = rows
        #: committed blocks: key -> (payload, checksum)
        self._blocks: dict[OffloadKey, tuple[bytes, int]] = {}
        self._queue: deque[TierWork] = deque()
        self._fail_next: list[Failure] = []
        #: while True, queued jobs stay queued (in flight)
        self.paused = False
        #: every key a store job failed (refused, injected failure), for tests to reason with
        self.refused_keys: set[OffloadKey] = set()

    # -- failure injection (tests) --------------------------------------------------------------

    def fail_next(self, count: int = 1, reason: Failure | str = "EIO") -> None:
        """Make the next ``count`` jobs to run fail every key with ``reason`` (a Failure, or
        an errno name such as ``"ENOSPC"``)."""
        if isinstance(reason, str):
            reason = Failure.os_error(getattr(errno, reason))
        self._fail_next.extend([reason] * count)

    def corrupt(self, key: OffloadKey) -> None:
        """Flip one byte of ``key``'s stored payload, as a bad disk sector would."""
        payload, checksum = self._blocks[key]
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 0xFF
        self._blocks[key] = (bytes(damaged), checksum)

    # -- the medium -------------------------------------------------------------------------------

    def _start_store(self, work: TierWork) -> None:
        for key in work.victims:
            self._blocks.pop(key, None)
        self._queue.append(work)

    def _start_load(self, work: TierWork) -> None:
        self._queue.append(work)

    def _finished_work(self) -> list[TierWork]:
        if self.paused:
            return []
        done = []
        while self._queue:
            work = self._queue.popleft()
            self._run(work)
            done.append(work)
        return done

    def drain_jobs(self) -> None:
        # Jobs run when polled; draining means nothing is left in flight once results are
        # taken, which the manager does right after.
        self.paused = False

    def has_pending_work(self) -> bool:
        return bool(self._queue) or super().has_pending_work()

    def get_finished_jobs(self) -> list[TierJobResult]:
        results = super().get_finished_jobs()
        for result in results:
            if not result.is_load:
                self.refused_keys.update(result.failed)
        return results

    def check(self, fix: bool = False) -> CheckReport:
        report = CheckReport(self.name, blocks_checked=len(self._blocks))
        bad = []
        for key, (payload, checksum) in list(self._blocks.items()):
            if xxhash.xxh3_64_intdigest(payload) != checksum:
                report.problems.append(f"{key.hex()}: checksum mismatch")
                bad.append(key)
        if fix and bad:
            for key in bad:
                del self._blocks[key]
            self._forget(bad)
            report.fixed.append(f"dropped {len(bad)} blocks")
        return report

    def close(self) -> None:
        self.get_finished_jobs()

    # -- running a job ----------------------------------------------------------------------------

    def _run(self, work: TierWork) -> None:
        injected = self._fail_next.pop(0) if self._fail_next else None
        for index, (key, row) in enumerate(zip(work.keys, work.rows)):
            if injected is not None:
                work.reasons[index] = injected
            elif work.is_load:
                work.reasons[index] = self._read_into(key, row)
            else:
                payload = self._rows[row].tobytes()
                self._blocks[key] = (payload, xxhash.xxh3_64_intdigest(payload))

    def _read_into(self, key: OffloadKey, row: int) -> Failure | None:
        entry = self._blocks.get(key)
        if entry is None:
            return Failure.MISSING
        payload, checksum = entry
        if len(payload) != self.block_bytes:
            # a block cut short (or grown) cannot even be copied into its row: dropped, counted
            del self._blocks[key]
            return Failure.corrupt("truncated" if len(payload) < self.block_bytes else "payload length")
        self._rows[row] = np.frombuffer(payload, dtype=np.uint8)
        if xxhash.xxh3_64_intdigest(self._rows[row]) != checksum:
            # Verified after the copy, where the bytes will be served from: a corrupt block
            # is dropped, never served (the bookkeeping drops it from the index and counts it).
            del self._blocks[key]
            return Failure.corrupt("checksum")
        return None

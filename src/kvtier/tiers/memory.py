"""The in-memory tiers: the smallest working examples, the test doubles, the templates.

- :class:`MemoryBackend` / :class:`NullBackend`: a first tier (a ``Backend``) whose rows live in
  this process's memory. A SlotBackend needs a spec type for its medium and a place for its
  rows, nothing else; the manager and the policy do the rest.
- :class:`MemoryTier`: a lower tier keeping the whole :class:`~kvtier.tiers.base.SecondaryTier`
  contract — reserved-while-written keys, eviction that spares keys being read, verified
  loads, events — with none of a disk's machinery. It runs jobs when asked rather than on
  threads, so tests decide exactly when a job finishes. Failure injection
  (:meth:`MemoryTier.fail_next`, :meth:`MemoryTier.corrupt`) drives the manager's error paths.

Copy this file to start a new tier.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Collection

import numpy as np
import xxhash

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.mediums import MemoryLoadStoreSpec
from kvtier.tiers.base import CheckReport, SecondaryTier, TierJob, TierJobResult
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


class MemoryTier(SecondaryTier):
    """Up to ``capacity_blocks`` blocks as ``bytes``, LRU-evicted, checksummed with xxh3-64.

    ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view that jobs copy from and
    into. Jobs queue on submission and run at the next :meth:`get_finished_jobs` (or
    :meth:`drain_jobs`), unless :attr:`paused` holds them back.
    """

    medium = "MEMORY_STORE"

    def __init__(self, name: str, rows: np.ndarray, capacity_blocks: int):
        super().__init__(name, rows.shape[1], capacity_blocks)
        self._rows = rows
        #: committed blocks, oldest use first: key -> (payload, checksum)
        self._blocks: OrderedDict[OffloadKey, tuple[bytes, int]] = OrderedDict()
        self._writing: set[OffloadKey] = set()  # reserved by a queued store job
        self._reading: dict[OffloadKey, int] = {}  # key -> queued load jobs naming it
        self._queue: deque[tuple[TierJob, bool, float, dict[OffloadKey, str]]] = deque()
        self._events: list[OffloadingEvent] = []
        self._fail_next: list[str] = []
        #: while True, queued jobs stay queued (in flight)
        self.paused = False
        self.counters = {"stored": 0, "loaded": 0, "evicted": 0, "failed_keys": 0, "corrupt": 0}
        #: every key a store job failed (refused, injected failure), for tests to reason with
        self.refused_keys: set[OffloadKey] = set()

    # -- failure injection (tests) --------------------------------------------------------------

    def fail_next(self, count: int = 1, reason: str = "EIO") -> None:
        """Make the next ``count`` jobs to run fail every key with ``reason``."""
        self._fail_next.extend([reason] * count)

    def corrupt(self, key: OffloadKey) -> None:
        """Flip one byte of ``key``'s stored payload, as a bad disk sector would."""
        payload, checksum = self._blocks[key]
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 0xFF
        self._blocks[key] = (bytes(damaged), checksum)

    # -- the contract -----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        if key in self._blocks:
            return True
        return None if key in self._writing else False

    def touch(self, keys: Collection[OffloadKey]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def submit_store(self, job: TierJob) -> None:
        failed: dict[OffloadKey, str] = {}
        new = [k for k in job.keys if k not in self._blocks and k not in self._writing]
        room = self.capacity_blocks - len(self._blocks) - len(self._writing)
        if len(new) > room:
            # Evict the oldest blocks nobody is reading and this job does not name.
            offered = set(job.keys)
            victims = []
            for key in self._blocks:
                if len(victims) == len(new) - room:
                    break
                if key not in self._reading and key not in offered:
                    victims.append(key)
            for key in victims:
                del self._blocks[key]
            if victims:
                self.counters["evicted"] += len(victims)
                self._events.append(OffloadingEvent(victims, self.block_bytes, self.medium, True))
            room += len(victims)
        for key in new[room:]:
            failed[key] = "full"
        self._writing.update(new[:room])
        self._queue.append((job, False, time.perf_counter(), failed))

    def submit_load(self, job: TierJob) -> None:
        for key in job.keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        self._queue.append((job, True, time.perf_counter(), {}))

    def get_finished_jobs(self) -> list[TierJobResult]:
        if self.paused:
            return []
        results = []
        while self._queue:
            results.append(self._run(*self._queue.popleft()))
        return results

    def drain_jobs(self) -> None:
        # Jobs run when polled; draining means nothing is left in flight once results are
        # taken, which the manager does right after.
        self.paused = False

    def has_pending_work(self) -> bool:
        return bool(self._queue)

    def num_blocks(self) -> int:
        return len(self._blocks)

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        return {**self.counters, "blocks": len(self._blocks)}

    def check(self, fix: bool = False) -> CheckReport:
        report = CheckReport(self.name, blocks_checked=len(self._blocks))
        for key, (payload, checksum) in list(self._blocks.items()):
            if xxhash.xxh3_64_intdigest(payload) != checksum:
                report.problems.append(f"{key.hex()}: checksum mismatch")
                if fix:
                    del self._blocks[key]
                    report.fixed.append(f"{key.hex()}: dropped")
        return report

    def close(self) -> None:
        self.get_finished_jobs()

    # -- running a job ----------------------------------------------------------------------------

    def _run(self, job: TierJob, is_load: bool, submitted: float, failed: dict) -> TierJobResult:
        result = TierJobResult(job.job_id, is_load, failed=dict(failed))
        injected = self._fail_next.pop(0) if self._fail_next else None
        for key, row in zip(job.keys, job.rows):
            if key in result.failed:
                continue
            if injected is not None:
                result.failed[key] = injected
            elif is_load:
                reason = self._read_into(key, row)
                if reason is None:
                    result.ok.append(key)
                else:
                    result.failed[key] = reason
            elif key in self._writing:
                payload = self._rows[row].tobytes()
                self._blocks[key] = (payload, xxhash.xxh3_64_intdigest(payload))
                result.ok.append(key)
            else:
                result.ok.append(key)  # was committed already
        if is_load:
            for key in job.keys:
                count = self._reading.pop(key)
                if count > 1:
                    self._reading[key] = count - 1
        else:
            stored = [k for k in result.ok if k in self._writing]
            self._writing.difference_update(job.keys)
            if stored:
                self.counters["stored"] += len(stored)
                self._events.append(OffloadingEvent(stored, self.block_bytes, self.medium, False))
        self.counters["failed_keys"] += len(result.failed)
        if not is_load:
            self.refused_keys.update(result.failed)
        if is_load:
            self.counters["loaded"] += len(result.ok)
        result.nbytes = len(result.ok) * self.block_bytes
        result.seconds = time.perf_counter() - submitted
        return result

    def _read_into(self, key: OffloadKey, row: int) -> str | None:
        entry = self._blocks.get(key)
        if entry is None:
            return "missing"
        payload, checksum = entry
        self._rows[row] = np.frombuffer(payload, dtype=np.uint8)
        if xxhash.xxh3_64_intdigest(self._rows[row]) != checksum:
            # Verified after the copy, where the bytes will be served from: a corrupt block
            # is dropped and counted, never served.
            del self._blocks[key]
            self.counters["corrupt"] += 1
            self._events.append(OffloadingEvent([key], self.block_bytes, self.medium, True))
            return "corrupt: checksum"
        return None

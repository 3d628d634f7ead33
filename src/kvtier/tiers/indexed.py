"""The scheduler-side bookkeeping lower tiers share: :class:`IndexedTier` and its counters.

:class:`IndexedTier` implements the whole :class:`~kvtier.tiers.contract.SecondaryTier` job
contract over an eviction policy; a medium subclass only starts the byte copies and hands
back what finished. :class:`TierCounters` is the thread-safe counter set behind ``stats()``.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from bisect import bisect_right
from collections.abc import Collection, Container, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.policies.base import EvictionPolicy
from kvtier.tiers.contract import SecondaryTier
from kvtier.tiers.jobs import Failure, FailureKind, TierJob, TierJobResult, TierWork

__all__ = ["IndexedTier", "TierCounters"]


class TierCounters:
    """A tier's counters, added to by any thread (under a lock), read by ``stats()``."""

    def __init__(self) -> None:
        #: held for each change; a tier may also hold it briefly for its own one-off flags
        self.lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self._values[name] = self._values.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self._values)


@dataclass
class _Pending:
    """A submitted job's bookkeeping on the scheduler side, until its result is polled."""

    job: TierJob
    is_load: bool
    ok: list[OffloadKey]
    failed: dict[OffloadKey, Failure]
    submitted_s: float


class _Skip:
    """Keys an eviction must pass over: those being read and those of the store's own offer."""

    __slots__ = ("offered", "reading")

    def __init__(self, reading: Container[OffloadKey], offered: Container[OffloadKey]):
        self.reading = reading
        self.offered = offered

    def __contains__(self, key: object) -> bool:
        return key in self.reading or key in self.offered


class IndexedTier(SecondaryTier):
    """The scheduler-side bookkeeping every lower tier shares, over an eviction policy.

    Implements the whole :class:`SecondaryTier` job contract on the scheduler thread with
    in-memory state only: the policy (key -> block id, in eviction order) is the index of
    committed keys; keys reserved while a store writes them look up ``None``; keys being read
    are counted and never evicted; a store evicts (sparing its own offer and keys being read)
    to make room and fails what still does not fit with ``Failure.FULL``; results fold in per
    key, a load that proves a block gone (missing, corrupt) drops it from the index; every
    block stored or dropped yields an :class:`~kvtier.base.OffloadingEvent`.

    A medium subclass implements three hooks, and never touches this state:

    * :meth:`_start_store` (scheduler thread, must not wait for I/O): remove ``work.victims``
      (block ids ``work.victim_ids``) from the medium, then write ``work.keys`` from
      ``work.rows``; fill ``work.reasons`` and ``work.block_ids``;
    * :meth:`_start_load` (same): read ``work.keys`` into ``work.rows`` and verify each;
      a block that fails verification is removed from the medium and reported
      ``Failure.corrupt(...)``;
    * :meth:`_finished_work` (scheduler thread, never waits): the work finished since the
      last call, each once.

    Room is counted in *units*: a block is one unit, unless the medium stores blocks of
    varying size (a ``files`` tier with a ``lossless`` codec) and counts them in pages: then
    ``capacity_units`` is its capacity in pages, ``block_units`` the most one block takes, and
    each block's id is its size in pages. A key being written holds ``block_units`` until its
    store completes with its real size; a store evicts until the units it needs are free.

    Class attributes: :attr:`max_key_bytes` (longer keys fail with ``KEY_TOO_LONG``).
    """

    #: the longest key the medium stores (None: no limit)
    max_key_bytes: ClassVar[int | None] = None
    #: failures ``stats()`` shows at 0 before the first one (``failed_<reason>``, and
    #: ``corrupt_<check>`` for a corrupt one): an exporter then has their series from the
    #: start, so a dashboard shows 0 rather than no data, and an alert on their rate sees the
    #: first one (a series that appears with its first count has no rate yet)
    zero_failures: ClassVar[tuple[Failure, ...]] = (Failure.FULL,)

    def __init__(
        self,
        name: str,
        block_bytes: int,
        capacity_blocks: int,
        policy: EvictionPolicy,
        *,
        capacity_units: int | None = None,
        block_units: int = 1,
    ):
        super().__init__(name, block_bytes, capacity_blocks)
        #: block ids are sizes in units (see the class docstring), not one unit a block
        self._sized = capacity_units is not None
        #: the room the tier has, in units (its blocks, where a block is one unit)
        self.capacity_units = capacity_units if capacity_units is not None else capacity_blocks
        #: the most units one block takes: what a key being written holds
        self._block_units = block_units
        #: units the committed blocks take
        self._held_units = 0
        #: committed keys -> block ids, in eviction order
        self._policy = policy
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}
        self._pending: dict[int, _Pending] = {}
        self._ready: list[TierJobResult] = []
        self._events: list[OffloadingEvent] = []
        self._counters = TierCounters()
        # Units other processes hold in a shared store, as last seen when the medium had to
        # refuse room (0 while this process is the only writer; see _complete_store).
        self._foreign_units = 0

    # -- medium hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _start_store(self, work: TierWork) -> None:
        """Begin a store (scheduler thread; never waits): evict ``victims``, write ``keys``."""

    @abstractmethod
    def _start_load(self, work: TierWork) -> None:
        """Begin a load (scheduler thread; never waits): read and verify ``keys``."""

    @abstractmethod
    def _finished_work(self) -> Iterable[TierWork]:
        """Work finished since the last call, each once (scheduler thread; never waits)."""

    def _list_foreign_blocks(self) -> None:
        """A shared medium refused room while this process holds under half of it (scheduler
        thread; never waits): list the blocks other processes stored and hand them to
        :meth:`_adopt_blocks` at a later poll. No-op for a medium only this process uses."""

    def _medium_stats(self) -> dict[str, int]:
        """The medium's own figures for :meth:`stats` (and zeros for counters it adds to
        ``_counters``, which override them once counted)."""
        return {}

    # -- the contract ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        if self._policy.contains(key):
            return True
        return None if key in self._writing else False

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self._policy.touch(keys)

    def submit_store(self, job: TierJob) -> None:
        policy = self._policy
        limit = self.max_key_bytes
        ok: list[OffloadKey] = []
        failed: dict[OffloadKey, Failure] = {}
        new_keys: list[OffloadKey] = []
        new_rows: list[int] = []
        present: set[OffloadKey] = set()  # committed keys of the offer: eviction spares them
        for key, row in zip(job.keys, job.rows):
            if policy.contains(key):
                ok.append(key)
                present.add(key)
            elif key in self._writing:
                ok.append(key)
            elif limit is not None and len(key) > limit:
                failed[key] = Failure.KEY_TOO_LONG
            else:
                new_keys.append(key)
                new_rows.append(row)
        victims: list[OffloadKey] = []
        victim_ids: list[int] = []
        if new_keys:
            need = self._block_units
            room = self._free_units() - self._foreign_units
            if len(new_keys) * need > room:
                victims, victim_ids = self._evict(len(new_keys) * need - room, present)
                room += self._units(victim_ids)
            fits = max(room, 0) // need
            for key in new_keys[fits:]:
                failed[key] = Failure.FULL
            del new_keys[fits:], new_rows[fits:]
        if victims:
            self._counters.add("evicted", len(victims))
            self._events.append(OffloadingEvent(victims, self.block_bytes, self.medium, True))
        pending = _Pending(job, False, ok, failed, time.perf_counter())
        if not new_keys and not victims:
            self._ready.append(self._result(pending))
            return
        self._writing.update(new_keys)
        self._pending[job.job_id] = pending
        self._start_store(
            TierWork(job.job_id, False, new_keys, new_rows, victims=victims, victim_ids=victim_ids)
        )

    def submit_load(self, job: TierJob) -> None:
        reading = self._reading
        for key in job.keys:
            reading[key] = reading.get(key, 0) + 1
        self._pending[job.job_id] = _Pending(job, True, [], {}, time.perf_counter())
        get = self._policy.get
        work = TierWork(job.job_id, True, list(job.keys), list(job.rows))
        work.block_ids = [get(key) or 0 for key in job.keys]
        self._start_load(work)

    def get_finished_jobs(self) -> list[TierJobResult]:
        results, self._ready = self._ready, []
        for work in self._finished_work():
            pending = self._pending.pop(work.job_id)
            if pending.is_load:
                results.append(self._complete_load(pending, work))
            else:
                results.append(self._complete_store(pending, work))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._pending) or bool(self._ready)

    def num_blocks(self) -> int:
        return len(self._policy)

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        figures = {"stored": 0, "loaded": 0, "evicted": 0, "failed_keys": 0, "corrupt": 0, "missing": 0}
        for reason in self.zero_failures:
            figures[f"failed_{reason.counter}"] = 0
            if reason.kind is FailureKind.CORRUPT:
                figures[f"corrupt_{reason.counter}"] = 0
        figures.update(self._medium_stats())
        figures.update(self._counters.snapshot())
        figures.update(
            blocks=len(self._policy),
            capacity_blocks=self.capacity_blocks,
            block_bytes=self.block_bytes,
            jobs_in_flight=len(self._pending),
        )
        return figures

    # -- helpers --------------------------------------------------------------------------------

    def _units(self, block_ids: Collection[int]) -> int:
        """The units blocks of ``block_ids`` take."""
        return sum(block_ids) if self._sized else len(block_ids)

    def _free_units(self) -> int:
        """Units neither held nor reserved by keys being written (this process's view)."""
        return self.capacity_units - self._held_units - len(self._writing) * self._block_units

    def _insert(self, keys: list[OffloadKey], block_ids: list[int]) -> None:
        """Commit ``keys`` (none present) to the index."""
        self._policy.insert(keys, block_ids)
        self._held_units += self._units(block_ids)
        if self._sized and self._held_units:
            # the blocks the capacity holds at the sizes held: an estimate
            self.capacity_blocks = self.capacity_units * len(self._policy) // self._held_units

    def _remove(self, key: OffloadKey) -> bool:
        """Drop ``key`` from the index; whether it was there."""
        block_id = self._policy.remove(key)
        if block_id is None:
            return False
        self._held_units -= self._units((block_id,))
        return True

    def _forget(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop ``keys`` from the index (a check found them bad or gone); the event; those dropped."""
        removed = [key for key in keys if self._remove(key)]
        if removed:
            self._events.append(OffloadingEvent(removed, self.block_bytes, self.medium, True))
        return removed

    def _evict(self, units: int, offered: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]]:
        """Victims in policy order freeing ``units`` (or as many as may go), sparing keys
        being read and ``offered`` (the committed keys of the store's own offer); their keys
        and block ids, dropped from the index."""
        policy = self._policy
        reading = self._reading
        protected = len(offered)
        if reading:
            contains = policy.contains
            protected += sum(1 for key in reading if key not in offered and contains(key))
        evictable = len(policy) - protected
        skip = _Skip(reading, offered) if protected else ()  # (): the policy pops without a test each
        keys: list[OffloadKey] = []
        block_ids: list[int] = []
        freed = 0
        # a block frees at most block_units: evict that many, then more if blocks were smaller
        while freed < units and evictable > 0:
            count = min(-(-(units - freed) // self._block_units), evictable)
            chosen = policy.evict(count, skip)
            if not chosen:
                break
            evictable -= len(chosen)
            keys.extend(key for key, _ in chosen)
            ids = [block_id for _, block_id in chosen]
            block_ids.extend(ids)
            freed += self._units(ids)
        self._held_units -= freed
        return keys, block_ids

    def _adopt_blocks(self, listed: list[tuple[OffloadKey, int, int]]) -> None:
        """Make blocks other processes stored known here, as the coldest (so evicted first).

        ``listed`` holds ``(key, recency stamp, block id)``. Rebuilds the policy (adopted
        blocks oldest stamp first, then this process's own in their eviction order): it runs
        only when the medium refused room and this process holds under half the store, so a
        rebuild per such event is cheap enough.
        """
        policy, writing = self._policy, self._writing
        adopted = [entry for entry in listed if not policy.contains(entry[0]) and entry[0] not in writing]
        # never more than the room this process's view leaves: its view may still count
        # blocks other processes removed since, and must not grow past the capacity
        room = self._free_units()
        adopted.sort(key=lambda entry: entry[1])
        del adopted[bisect_right(list(accumulate(self._units((e[2],)) for e in adopted)), room) :]
        if not adopted:
            return
        own = policy.clear()
        self._held_units = 0
        # Oldest first here, while a policy makes the first key of a call the newest (a
        # request's head): hand them over newest first.
        adopted.reverse()
        self._insert([e[0] for e in adopted], [e[2] for e in adopted])
        if own:
            own.reverse()
            self._insert([key for key, _ in own], [block_id for _, block_id in own])
        self._foreign_units = max(0, self._foreign_units - self._units([e[2] for e in adopted]))
        self._counters.add("adopted", len(adopted))

    def _result(self, pending: _Pending) -> TierJobResult:
        result = TierJobResult(pending.job.job_id, pending.is_load, ok=pending.ok, failed=pending.failed)
        result.seconds = time.perf_counter() - pending.submitted_s
        if result.failed:
            self._counters.add("failed_keys", len(result.failed))
            for reason in result.failed.values():
                self._counters.add(f"failed_{reason.counter}")
        return result

    def _complete_store(self, pending: _Pending, work: TierWork) -> TierJobResult:
        stored: list[OffloadKey] = []
        block_ids: list[int] = []
        for key, reason, block_id in zip(work.keys, work.reasons, work.block_ids):
            self._writing.discard(key)
            if reason is None:
                stored.append(key)
                block_ids.append(block_id)
            else:
                pending.failed[key] = reason
        if stored:
            # A job's keys come coldest first (the stack saves its coldest blocks first), and
            # a policy makes the first key of a call the newest: hand them over reversed, so
            # the coldest stays the oldest here too.
            self._insert(stored[::-1], block_ids[::-1])
            pending.ok.extend(stored)
            self._events.append(OffloadingEvent(stored, self.block_bytes, self.medium, False))
            self._counters.add("stored", len(stored))
        if work.shared_units is not None:
            own = self._held_units + len(self._writing) * self._block_units
            foreign = max(0, work.shared_units - own)
            # Only a refusal by the medium proves that other processes fill the store; without
            # one, an estimate can only shrink (this process's in-flight evictions would
            # otherwise look like foreign blocks and cause needless evictions).
            if work.refused:
                self._foreign_units = foreign
                if self._held_units < self.capacity_units // 2:
                    # Other processes fill the store and this one holds too few blocks to make
                    # room by evicting its own: it could never store again, even after they
                    # exit. Learn their blocks so that eviction can take them too.
                    self._list_foreign_blocks()
            else:
                self._foreign_units = min(self._foreign_units, foreign)
        result = self._result(pending)
        result.nbytes = len(stored) * self.block_bytes
        return result

    def _complete_load(self, pending: _Pending, work: TierWork) -> TierJobResult:
        reading = self._reading
        dropped: list[OffloadKey] = []
        for key, reason in zip(work.keys, work.reasons):
            count = reading.pop(key)
            if count > 1:
                reading[key] = count - 1
            if reason is None:
                pending.ok.append(key)
                continue
            pending.failed[key] = reason
            if reason.kind is FailureKind.MISSING:
                self._counters.add("missing")
            elif reason.kind is FailureKind.CORRUPT:
                self._counters.add("corrupt")
                self._counters.add(f"corrupt_{reason.counter}")
            if reason.block_gone and self._remove(key):
                dropped.append(key)
        if dropped:
            self._events.append(OffloadingEvent(dropped, self.block_bytes, self.medium, True))
        self._counters.add("loaded", len(pending.ok))
        result = self._result(pending)
        result.nbytes = len(pending.ok) * self.block_bytes
        return result

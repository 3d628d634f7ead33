"""The interface of every tier below the CPU tier ("secondary" tiers: disk, and test doubles).

A secondary tier never sees the GPU. Blocks reach it from the CPU tier and go back to the CPU
tier (docs/architecture.md): a store job copies CPU rows down, a load job copies blocks up into
CPU rows the manager reserved. The tier owns everything about its own medium — the index that
survives restarts, capacity and eviction, the on-disk format and its checksums — and the
manager owns the CPU rows and when to move what.

The shape follows vLLM 0.33's ``SecondaryTierManager`` (submit jobs, poll finished jobs), so
the same class can serve kvtier's own stack manager and, through a thin adapter, vLLM's tiering.
"""

from __future__ import annotations

import enum
import errno as errno_codes
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.policies.base import EvictionPolicy

__all__ = [
    "CheckReport",
    "Failure",
    "FailureKind",
    "IndexedTier",
    "SecondaryTier",
    "TierCounters",
    "TierJob",
    "TierJobResult",
    "TierWork",
]


class FailureKind(enum.Enum):
    """Why a key of a lower tier's job did not make it."""

    #: not on the tier (never stored, evicted, or removed by another process)
    MISSING = "missing"
    #: read back but failed verification (``detail`` says which check): dropped, never served
    CORRUPT = "corrupt"
    #: no room for it, even after evicting what could be evicted
    FULL = "full"
    #: longer than the medium can name
    KEY_TOO_LONG = "key too long"
    #: a system call failed (``errno`` says which: ENOSPC, EIO, EACCES ...)
    OS_ERROR = "os error"
    #: the tier's own index failed (``errno`` when the index reported one)
    INDEX = "index"
    #: a bug: an exception nobody expected (``detail`` is its type), logged with its traceback
    UNEXPECTED = "error"
    #: a remote tier's server could not be reached (``detail``: ``refused``, ``timeout``,
    #: ``closed``, ``connection``): the tier may hold the block still
    UNAVAILABLE = "unavailable"
    #: a remote tier's server refused the credentials (``detail``: ``wrong credentials``,
    #: ``no credentials``)
    AUTH = "auth"
    #: a remote tier's TLS handshake failed (``detail``: ``certificate`` or ``handshake``)
    TLS = "tls"
    #: a remote tier's server denied the command to this user (an ACL's ``NOPERM``;
    #: ``detail`` names the command)
    DENIED = "denied"
    #: a remote tier's server answered with an error (``detail``: its error code, ``OOM`` ...)
    SERVER = "server"


@dataclass(frozen=True)
class Failure:
    """The reason one key of a job failed: a kind, the errno where there is one, a detail."""

    kind: FailureKind
    #: the errno of an ``OS_ERROR`` (and of an ``INDEX`` failure that had one), else None
    errno: int | None = None
    #: what failed, in a word (the verification check of a ``CORRUPT`` block ...)
    detail: str = ""

    #: the reasons without an errno or detail, made once (set below the class)
    MISSING: ClassVar[Failure]
    FULL: ClassVar[Failure]
    KEY_TOO_LONG: ClassVar[Failure]

    @classmethod
    def os_error(cls, code: int) -> Failure:
        """A failed system call with errno ``code``."""
        return cls(FailureKind.OS_ERROR, code)

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        """``OS_ERROR`` with the errno of an OSError that has one, else ``UNEXPECTED``."""
        if isinstance(exc, OSError) and exc.errno:
            return cls(FailureKind.OS_ERROR, exc.errno)
        return cls(FailureKind.UNEXPECTED, detail=type(exc).__name__)

    @classmethod
    def corrupt(cls, check: str) -> Failure:
        """A block that failed verification at ``check`` (``checksum``, ``other key`` ...)."""
        return cls(FailureKind.CORRUPT, detail=check)

    @property
    def errno_name(self) -> str | None:
        """``ENOSPC`` for errno 28, ... (None without an errno)."""
        if self.errno is None:
            return None
        return errno_codes.errorcode.get(self.errno, f"errno {self.errno}")

    @property
    def block_gone(self) -> bool:
        """Whether the failure proves the tier no longer holds the block (missing, corrupt)."""
        return self.kind in (FailureKind.MISSING, FailureKind.CORRUPT)

    @property
    def counter(self) -> str:
        """The stats suffix of this reason: ``ENOSPC``, ``full``, ``checksum``, ``key_too_long``."""
        if self.kind is FailureKind.CORRUPT:
            text = self.detail
        elif self.kind is FailureKind.INDEX:
            text = self.errno_name or f"index_{self.detail}"
        else:
            text = str(self)
        return text.replace(": ", "_").replace(" ", "_")

    def __str__(self) -> str:
        if self.kind is FailureKind.OS_ERROR:
            return self.errno_name or "os error"
        if self.kind is FailureKind.CORRUPT:
            return f"corrupt: {self.detail}"
        if self.kind is FailureKind.INDEX:
            return f"index: {self.errno_name or self.detail}"
        if self.kind is FailureKind.UNEXPECTED:
            return f"error: {self.detail}"
        if self.kind in _REMOTE_KINDS and self.detail:
            return f"{self.kind.value}: {self.detail}"
        return self.kind.value


#: the kinds of a remote tier's failures, printed with their detail
_REMOTE_KINDS = frozenset(
    (FailureKind.UNAVAILABLE, FailureKind.AUTH, FailureKind.TLS, FailureKind.DENIED, FailureKind.SERVER)
)


Failure.MISSING = Failure(FailureKind.MISSING)
Failure.FULL = Failure(FailureKind.FULL)
Failure.KEY_TOO_LONG = Failure(FailureKind.KEY_TOO_LONG)


@dataclass(frozen=True)
class TierJob:
    """One batch of blocks to move between the CPU tier and a secondary tier.

    ``rows[i]`` is the CPU-tier row of ``keys[i]``: the source of a store, the destination of
    a load. The manager keeps those rows reserved (not reused, not evicted) until the job's
    result has been polled.
    """

    job_id: int
    keys: tuple[OffloadKey, ...]
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.rows):
            raise ValueError(f"job {self.job_id}: {len(self.keys)} keys but {len(self.rows)} rows")


@dataclass
class TierJobResult:
    """A finished job: which keys made it, and why the others did not.

    Store: a key is ``ok`` once it is committed on the tier (or was there already); Load: once
    its bytes are in the CPU row *and verified*. A key in ``failed`` maps to its
    :class:`Failure` (missing, corrupt and which check, full, an OS error with its errno ...);
    its CPU row holds nothing usable and must not be served.
    """

    job_id: int
    is_load: bool
    ok: list[OffloadKey] = field(default_factory=list)
    failed: dict[OffloadKey, Failure] = field(default_factory=dict)
    #: payload bytes moved for the ``ok`` keys
    nbytes: int = 0
    #: wall time from submission to completion
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        """Whether every key of the job made it."""
        return not self.failed


@dataclass
class CheckReport:
    """What :meth:`SecondaryTier.check` found: healthy when ``problems`` is empty."""

    tier: str
    blocks_checked: int = 0
    #: one line per problem found (a block that fails verification, an orphan file, ...)
    problems: list[str] = field(default_factory=list)
    #: what ``fix=True`` did about them
    fixed: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems


class SecondaryTier(ABC):
    """A tier below the CPU tier: a capacity-bounded, verified block store with its own index.

    Who calls it: the stack manager, on the engine's scheduler thread, under the engine's
    scheduler lock. Every method except :meth:`drain_jobs`, :meth:`wait_loads`, :meth:`check`
    and :meth:`close` must return without waiting for I/O: byte copies run on the tier's own threads, and their
    outcome is reported by :meth:`get_finished_jobs`. The tier's threads may only touch the
    CPU rows named by a job, and only until that job's result is handed over.

    The manager guarantees:

    * a store job's rows hold the keys' complete bytes, unchanged until the result is polled;
    * a load job's rows are reserved for it, and nothing else writes them meanwhile;
    * a key is never in two jobs of this tier at once.

    The implementation is responsible for:

    * a key that looked up ``True`` keeps being readable until the manager polls the load of
      it, or the key is evicted by a store (which never evicts a key being read);
    * skipping keys already present in a store job (reported ``ok``), evicting (per its
      configured policy) to make room, and failing keys it cannot place (``Failure.FULL``);
    * never reporting a load ``ok`` unless the bytes written into the row were verified
      (checksum, key, layout) — anything else is a failed key and a counted miss;
    * never losing a committed block on a failed job (ENOSPC, EIO ...): failures affect only
      the keys of that job;
    * an :class:`~kvtier.base.OffloadingEvent` per block stored or removed on this medium.
    """

    #: medium name carried by events and specs (``"LMDB"``, ``"FILES"`` ...)
    medium: str = ""
    #: whether the blocks live off this host (a shared server): how an engine that limits a
    #: request's tiers by locality (vLLM's ``kv_load_tiers``) tells this tier from a disk
    remote: bool = False

    def __init__(self, name: str, block_bytes: int, capacity_blocks: int):
        #: the tier's name in the stack (from configuration)
        self.name = name
        #: payload bytes of one block (one CPU row)
        self.block_bytes = block_bytes
        #: the most blocks the tier holds; it never holds more
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def lookup(self, key: OffloadKey) -> bool | None:
        """``True`` committed and readable, ``False`` absent, ``None`` not known yet: ask again
        after the next :meth:`on_schedule_end` (the key is being written, or a remote tier has
        queued the question for its server). The manager answers such a key ``None`` too, so
        the engine retries it next step; the tier must settle it (``True``/``False``) within a
        bounded number of steps. Never waits for I/O.
        """

    def on_schedule_end(self) -> None:
        """The scheduler step's lookups are over: send what they asked for (no-op default).

        Called by the manager at its own ``on_schedule_end``, on the scheduler thread; must
        not wait for I/O. A tier that cannot answer lookups from local state (a remote store)
        sends the step's queued questions here, as one batch.
        """

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` were used: refresh them in the tier's eviction order. Unknown keys ignored."""

    @abstractmethod
    def submit_store(self, job: TierJob) -> None:
        """Copy ``job.rows`` of the CPU tier down as ``job.keys``; returns at once."""

    @abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Copy ``job.keys`` into CPU rows ``job.rows``, verifying each; returns at once."""

    @abstractmethod
    def get_finished_jobs(self) -> list[TierJobResult]:
        """Results of the jobs finished since the last call, each once; never waits."""

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results stay queued for polling)."""

    def wait_loads(self) -> None:
        """Block until every submitted load job has finished; stores may still be running.

        For a reader that needs only its promotions (results stay queued for polling). A
        tier that cannot tell its loads apart may wait for everything, as this default does.
        """
        self.drain_jobs()

    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks committed on the tier now."""

    def has_pending_work(self) -> bool:
        """Whether jobs are in flight (the engine should keep stepping to poll them)."""
        return False

    def take_events(self) -> list[OffloadingEvent]:
        """Events (stored / removed on this medium) since the last call, each once."""
        return []

    def stats(self) -> dict[str, int]:
        """The tier's counters (bytes, jobs, failures, corrupt blocks, evictions ...)."""
        return {}

    def check(self, fix: bool = False) -> CheckReport:
        """Compare the index with what the medium holds; with ``fix``, drop what is bad.

        May block (it reads every block); not for the scheduler's hot path.
        """
        return CheckReport(self.name)

    def close(self) -> None:
        """Drain jobs and release files, threads and handles. Idempotent; blocks."""


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


@dataclass(eq=False)
class TierWork:
    """What a medium must do for one job: its keys not settled by the bookkeeping.

    Built by :class:`IndexedTier` on the scheduler thread and handed to the medium
    (``_start_store`` / ``_start_load``); the medium fills ``reasons`` (and ``block_ids`` for
    stores, ``shared_blocks``/``refused`` where the store is shared by processes) and hands it
    back through ``_finished_work``. Between the two only the medium touches it.
    """

    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    #: ``rows[i]``: the CPU row of ``keys[i]`` (the source of a store, the target of a load)
    rows: list[int]
    #: store jobs: keys the bookkeeping evicted to make room; the medium removes them first
    victims: list[OffloadKey] = field(default_factory=list)
    #: per key: None (done) or why it failed
    reasons: list[Failure | None] = field(default_factory=list)
    #: per key: where the block lies on the medium (a slot; 0 where the medium has none)
    block_ids: list[int] = field(default_factory=list)
    #: store jobs of a store shared by processes: blocks on the medium, all processes
    #: together, when the medium counted them (None: not shared, or not counted)
    shared_blocks: int | None = None
    #: store jobs: keys the medium refused for lack of room (other processes filled it)
    refused: int = 0

    def __post_init__(self) -> None:
        if not self.reasons:
            self.reasons = [None] * len(self.keys)
        if not self.block_ids:
            self.block_ids = [0] * len(self.keys)


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
      from the medium, then write ``work.keys`` from ``work.rows``; fill ``work.reasons``
      and ``work.block_ids``;
    * :meth:`_start_load` (same): read ``work.keys`` into ``work.rows`` and verify each;
      a block that fails verification is removed from the medium and reported
      ``Failure.corrupt(...)``;
    * :meth:`_finished_work` (scheduler thread, never waits): the work finished since the
      last call, each once.

    Class attributes: :attr:`max_key_bytes` (longer keys fail with ``KEY_TOO_LONG``).
    """

    #: the longest key the medium stores (None: no limit)
    max_key_bytes: ClassVar[int | None] = None

    def __init__(self, name: str, block_bytes: int, capacity_blocks: int, policy: EvictionPolicy):
        super().__init__(name, block_bytes, capacity_blocks)
        #: committed keys -> block ids, in eviction order
        self._policy = policy
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}
        self._pending: dict[int, _Pending] = {}
        self._ready: list[TierJobResult] = []
        self._events: list[OffloadingEvent] = []
        self._counters = TierCounters()
        # Blocks other processes hold in a shared store, as last seen when the medium had to
        # refuse room (0 while this process is the only writer; see _complete_store).
        self._foreign_blocks = 0

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
        if new_keys:
            room = self.capacity_blocks - len(policy) - len(self._writing) - self._foreign_blocks
            if len(new_keys) > room:
                victims = self._evict(len(new_keys) - room, present)
                room += len(victims)
            room = max(room, 0)
            for key in new_keys[room:]:
                failed[key] = Failure.FULL
            del new_keys[room:], new_rows[room:]
        if victims:
            self._counters.add("evicted", len(victims))
            self._events.append(OffloadingEvent(victims, self.block_bytes, self.medium, True))
        pending = _Pending(job, False, ok, failed, time.perf_counter())
        if not new_keys and not victims:
            self._ready.append(self._result(pending))
            return
        self._writing.update(new_keys)
        self._pending[job.job_id] = pending
        self._start_store(TierWork(job.job_id, False, new_keys, new_rows, victims=victims))

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

    def _forget(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop ``keys`` from the index (a check found them bad or gone); the event; those dropped."""
        removed = [key for key in keys if self._policy.remove(key) is not None]
        if removed:
            self._events.append(OffloadingEvent(removed, self.block_bytes, self.medium, True))
        return removed

    def _evict(self, count: int, offered: set[OffloadKey]) -> list[OffloadKey]:
        """Up to ``count`` victims in policy order, sparing keys being read and ``offered``
        (the committed keys of the store's own offer)."""
        policy = self._policy
        reading = self._reading
        protected = len(offered)
        if reading:
            contains = policy.contains
            protected += sum(1 for key in reading if key not in offered and contains(key))
        count = min(count, len(policy) - protected)
        if count <= 0:
            return []
        if protected:
            chosen = policy.evict(count, _Skip(reading, offered))
        else:  # nothing to pass over: the policy pops its coldest without a membership test each
            chosen = policy.evict(count, ())
        return [key for key, _ in chosen] if chosen else []

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
        room = self.capacity_blocks - len(policy) - len(writing)
        adopted.sort(key=lambda entry: entry[1])
        del adopted[max(room, 0):]
        if not adopted:
            return
        own = policy.clear()
        # Oldest first here, while a policy makes the first key of a call the newest (a
        # request's head): hand them over newest first.
        adopted.reverse()
        policy.insert([e[0] for e in adopted], [e[2] for e in adopted])
        if own:
            own.reverse()
            policy.insert([key for key, _ in own], [block_id for _, block_id in own])
        self._foreign_blocks = max(0, self._foreign_blocks - len(adopted))
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
            self._policy.insert(stored[::-1], block_ids[::-1])
            pending.ok.extend(stored)
            self._events.append(OffloadingEvent(stored, self.block_bytes, self.medium, False))
            self._counters.add("stored", len(stored))
        if work.shared_blocks is not None:
            own = len(self._policy) + len(self._writing)
            foreign = max(0, work.shared_blocks - own)
            # Only a refusal by the medium proves that other processes fill the store; without
            # one, an estimate can only shrink (this process's in-flight evictions would
            # otherwise look like foreign blocks and cause needless evictions).
            if work.refused:
                self._foreign_blocks = foreign
                if len(self._policy) < self.capacity_blocks // 2:
                    # Other processes fill the store and this one holds too few blocks to make
                    # room by evicting its own: it could never store again, even after they
                    # exit. Learn their blocks so that eviction can take them too.
                    self._list_foreign_blocks()
            else:
                self._foreign_blocks = min(self._foreign_blocks, foreign)
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
            if reason.block_gone and self._policy.remove(key) is not None:
                dropped.append(key)
        if dropped:
            self._events.append(OffloadingEvent(dropped, self.block_bytes, self.medium, True))
        self._counters.add("loaded", len(pending.ok))
        result = self._result(pending)
        result.nbytes = len(pending.ok) * self.block_bytes
        return result

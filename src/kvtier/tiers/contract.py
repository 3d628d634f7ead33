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

from abc import ABC, abstractmethod
from collections.abc import Collection

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.tiers.jobs import CheckReport, Failure, TierJob, TierJobResult

__all__ = ["SecondaryTier"]


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

    def miss_reason(self, key: OffloadKey) -> Failure | None:
        """Why :meth:`lookup` just answered ``False`` for ``key``, where the tier knows more
        than "absent": its server is unreachable (``UNAVAILABLE``), or a read of it found a
        block that failed verification (``CORRUPT`` and the check). None (the default): absent,
        as far as the tier knows.

        Called by the manager on the scheduler thread, only after a lookup missed, to count
        the miss under its cause; must not wait for I/O.
        """
        return None

    def probe_foreign(self, key: OffloadKey) -> None:
        """``key`` missed and was never stored here: look, bounded and in the background, for
        the same key under a sibling this tier can see (another namespace on a shared server),
        reported by :meth:`foreign_found`. No-op default; must not wait for I/O, and may drop
        the request (a probe is a diagnosis: a tier limits how many keys it probes a step)."""

    def foreign_found(self) -> list[tuple[OffloadKey, str]]:
        """``(key, part)`` for each probed key found under a sibling since the last call; the
        part names what differs (``layout``, ``tp``, ``namespace``). Never waits."""
        return []

    def foreign_stored(self) -> tuple[str, list[OffloadKey]] | None:
        """Keys this tier held under another identity and dropped before serving (a disk
        store wiped when it opened under another layout), with the part that differed
        (``layout``, ``tp``), or None (the default). The manager asks once, as it starts, so
        their misses count as ``foreign``, not ``new``."""
        return None

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

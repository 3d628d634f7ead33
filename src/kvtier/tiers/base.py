"""The interface of every tier below the CPU tier ("secondary" tiers: disk, and test doubles).

A secondary tier never sees the GPU. Blocks reach it from the CPU tier and go back to the CPU
tier (DESIGN.md section 2): a store job copies CPU rows down, a load job copies blocks up into
CPU rows the manager reserved. The tier owns everything about its own medium — the index that
survives restarts, capacity and eviction, the on-disk format and its checksums — and the
manager owns the CPU rows and when to move what.

The shape follows vLLM 0.33's ``SecondaryTierManager`` (submit jobs, poll finished jobs), so
the same class can serve kvtier's own stack manager and, through a thin adapter, vLLM's tiering.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

from kvtier.base import OffloadingEvent, OffloadKey

__all__ = ["TierJob", "TierJobResult", "CheckReport", "SecondaryTier"]


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
    its bytes are in the CPU row *and verified*. A key in ``failed`` maps to a short reason
    (``"missing"``, ``"corrupt: checksum"``, ``"ENOSPC"``, ``"full"`` ...); its CPU row holds
    nothing usable and must not be served.
    """

    job_id: int
    is_load: bool
    ok: list[OffloadKey] = field(default_factory=list)
    failed: dict[OffloadKey, str] = field(default_factory=dict)
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
    scheduler lock. Every method except :meth:`drain_jobs`, :meth:`check` and :meth:`close`
    must return without waiting for I/O: byte copies run on the tier's own threads, and their
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
      configured policy) to make room, and failing keys it cannot place (``"full"``);
    * never reporting a load ``ok`` unless the bytes written into the row were verified
      (checksum, key, layout) — anything else is a failed key and a counted miss;
    * never losing a committed block on a failed job (ENOSPC, EIO ...): failures affect only
      the keys of that job;
    * an :class:`~kvtier.base.OffloadingEvent` per block stored or removed on this medium.
    """

    #: medium name carried by events and specs (``"LMDB"``, ``"FILES"`` ...)
    medium: str = ""

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

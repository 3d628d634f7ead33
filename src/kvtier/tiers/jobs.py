"""The types a lower tier's jobs are made of: jobs, their results, failures, check reports.

A :class:`TierJob` goes down to a tier, a :class:`TierJobResult` comes back with a
:class:`Failure` per key that did not make it; :class:`TierWork` is what the shared
bookkeeping (:class:`~kvtier.tiers.indexed.IndexedTier`) hands a medium for one job.
"""

from __future__ import annotations

import enum
import errno as errno_codes
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.base import OffloadKey

__all__ = [
    "CheckReport",
    "Failure",
    "FailureKind",
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


@dataclass(eq=False)
class TierWork:
    """What a medium must do for one job: its keys not settled by the bookkeeping.

    Built by :class:`IndexedTier` on the scheduler thread and handed to the medium
    (``_start_store`` / ``_start_load``); the medium fills ``reasons`` (and ``block_ids`` for
    stores, ``shared_units``/``refused`` where the store is shared by processes) and hands it
    back through ``_finished_work``. Between the two only the medium touches it.
    """

    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    #: ``rows[i]``: the CPU row of ``keys[i]`` (the source of a store, the target of a load)
    rows: list[int]
    #: store jobs: keys the bookkeeping evicted to make room; the medium removes them first
    victims: list[OffloadKey] = field(default_factory=list)
    #: their block ids, as the index held them
    victim_ids: list[int] = field(default_factory=list)
    #: per key: None (done) or why it failed
    reasons: list[Failure | None] = field(default_factory=list)
    #: per key: where the block lies on the medium (a slot; 0 where the medium has none), or
    #: the room it takes where the tier counts units (see :class:`~kvtier.tiers.indexed.IndexedTier`)
    block_ids: list[int] = field(default_factory=list)
    #: store jobs of a store shared by processes: the room its blocks take, all processes
    #: together, in the tier's units, when the medium counted them (None: not shared, or not
    #: counted)
    shared_units: int | None = None
    #: store jobs: keys the medium refused for lack of room (other processes filled it)
    refused: int = 0

    def __post_init__(self) -> None:
        if not self.reasons:
            self.reasons = [None] * len(self.keys)
        if not self.block_ids:
            self.block_ids = [0] * len(self.keys)

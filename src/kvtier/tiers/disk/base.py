"""What the two disk tiers (``lmdb``, ``files``) share: opening a store, the mover plumbing,
durable recency, and the logging of failed jobs.

A disk tier is split along the thread boundary the contract draws
(:class:`~kvtier.tiers.base.SecondaryTier`):

* **scheduler thread** — ``lookup``, ``touch``, ``submit_*``, ``get_finished_jobs`` ... are
  :class:`~kvtier.tiers.base.IndexedTier`'s bookkeeping, shared with the in-memory test tier: an
  eviction policy (key -> block id, in eviction order), the keys being written and read,
  pending jobs, events. They never wait for I/O; the work goes to the mover as
  :class:`~kvtier.tiers.disk.mover.MoverJob` objects.
* **mover threads** — the medium's hooks (``_store_before``, ``_store_block``,
  ``_store_after``, ``_load_block`` ...) do the I/O (through :class:`~kvtier.tiers.disk.blockio.BlockIO`)
  and the on-disk index, and report per-key :class:`~kvtier.tiers.base.Failure` values.
  They never touch the scheduler-side state; the scheduler folds their results in when it
  polls.

The on-disk state is the truth shared by every process using the path; each process's
in-memory policy is its view of it, built at open (so a restart finds every committed block)
and kept in step by its own jobs. Loads always re-resolve a key on disk, and every block read
is verified, so a view made stale by another process costs a miss, never wrong bytes.

Opening is :mod:`kvtier.tiers.disk.store`'s (directory, locks, manifest, O_DIRECT), then the
medium's ``_open_medium`` (its files and index).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from abc import abstractmethod
from collections.abc import Collection, Iterable
from functools import partial
from typing import Any, ClassVar, TypeVar

import numpy as np
from typing_extensions import Self

from kvtier.base import OffloadKey
from kvtier.codecs import BlockCodec, make_codec
from kvtier.config import format_size
from kvtier.errors import ConfigError
from kvtier.policies import EvictionPolicy, get_policy_class
from kvtier.tiers.indexed import IndexedTier
from kvtier.tiers.jobs import CheckReport, Failure, FailureKind, TierWork
from kvtier.tiers.disk.blockio import BlockIO, RowIO
from kvtier.tiers.disk.config import FSYNC_CHOICES, O_DIRECT_CHOICES, DiskTierConfig, free_bytes, room_problem
from kvtier.tiers.disk.format import PAGE_BYTES, LayoutFingerprint, on_disk_block_bytes
from kvtier.tiers.disk.mover import Mover, MoverJob
from kvtier.tiers.disk.store import (
    StoreLocks,
    Wiped,
    claim_path,
    decide_direct,
    default_store_path,
    open_store_directory,
    prepare_directory,
    release_path,
    settle_manifest,
    store_os_fix,
)
from kvtier.tiers.secret import TierKeys, tier_keys

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_Tier = TypeVar("_Tier", bound="DiskTier")
# touch() persists recency in batches of this many keys (and at close): per-touch writes would
# put a disk write on every cache hit, and recency is only a hint for eviction after restart.
_TOUCH_BATCH = 4096
# failures not worth a warning of their own: expected outcomes, or logged where they happen
_QUIET = (FailureKind.MISSING, FailureKind.FULL, FailureKind.CORRUPT)
# how a store is opened: by an engine, by `kvtier check` (read-only), by `kvtier check --fix`
_ACCESS = ("serve", "check", "fix")


class DiskTier(IndexedTier):
    """The part of a disk tier that is the same for every medium (see the module docstring).

    Subclasses set :attr:`kind`, :attr:`medium`, :attr:`max_key_bytes` and
    :attr:`medium_names`, and implement the medium hooks (``_open_medium`` ... ``_close_medium``),
    which run on mover threads except ``_open_medium``/``_check_medium``/``_close_medium``
    (caller's thread, blocking by design).
    """

    #: the configuration ``kind`` this class serves
    kind: ClassVar[str] = ""
    #: entries of the store directory that belong to the medium (removed when wiping)
    medium_names: ClassVar[tuple[str, ...]] = ()
    #: whether blocks of a codec of varying size take only their own pages (``files``), and
    #: room is counted in pages; else each takes a slot for the largest (``lmdb``'s slab)
    sizes_blocks: ClassVar[bool] = False
    #: a full, failing or read-only disk, and a block that fails its checksum (docs/operations.md)
    zero_failures = (
        Failure.FULL,
        *(Failure.os_error(code) for code in (errno.ENOSPC, errno.EIO, errno.EROFS, errno.EACCES)),
        Failure.corrupt("checksum"),
    )
    #: what a store of another layout held before this open wiped it (foreign_stored)
    _wiped: Wiped | None

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def stored_keys(cls, directory: str, limit: int) -> list[OffloadKey]:
        """Up to ``limit`` keys the store in ``directory`` holds, read from its index or names
        without opening it for serving (the caller holds the store alone): those of a store
        about to be wiped for another layout. Default: none known."""
        return []

    def foreign_stored(self) -> tuple[str, list[OffloadKey]] | None:
        """The keys of a store of another layout wiped when this tier opened, with the part
        of the layout that differed; handed over once (then None)."""
        wiped, self._wiped = self._wiped, None
        return None if wiped is None else (wiped.part, wiped.keys)

    @classmethod
    def open(
        cls,
        config: DiskTierConfig,
        rows: np.ndarray,
        fingerprint: LayoutFingerprint,
        *,
        field: str = "tiers[1]",
        threads: int | None = None,
        access: str = "serve",
        wiped_keys: int = 0,
    ) -> DiskTier:
        """Open (creating if need be) the store at ``config.path`` for CPU rows ``rows``.

        ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view that jobs copy from
        and into; ``fingerprint`` describes what the bytes are. Called once, by whoever builds
        the tier stack, on its own thread; blocks for the directory checks, the lock, the
        index scan (~0.1-0.5 s per 100,000 blocks) and, for a new store, its creation.
        Raises :class:`ConfigError` naming ``<field>.<key>`` for anything the configuration
        or the directory gets wrong, with the fix, and :class:`~kvtier.errors.IndexDamagedError`
        for an index found damaged.

        ``access`` is ``serve`` (an engine's tier), ``check`` (``kvtier check`` without
        ``--fix``: every file opened read-only, nothing created or written, a damaged index
        reported by :meth:`check` rather than raised) or ``fix`` (``kvtier check --fix``:
        like ``serve``, but a damaged index is left for :meth:`check` to rebuild).

        ``wiped_keys``: when the store is of another layout and wiped, how many of its keys to
        list first and hand to :meth:`foreign_stored` (a stack counting miss causes asks; 0,
        the default, lists none).
        """
        if access not in _ACCESS:
            raise ConfigError("access", access, "one of " + ", ".join(_ACCESS))
        read_only = access == "check"
        cls._check_config(config, field)
        keys = tier_keys(config, field)  # before anything is created: a bad secret file changes nothing
        codec = make_codec(config.codec, fingerprint.block_bytes, fingerprint.dtype, field)
        # the layout as stored here: a store of another codec is another layout (wiped at open)
        fingerprint = fingerprint.with_codec(config.codec)
        try:
            rowio = RowIO(rows)
        except ValueError as exc:
            raise ConfigError("rows", getattr(rows, "shape", rows), "the CPU tier's rows", str(exc)) from None
        if fingerprint.block_bytes != rowio.block_bytes:
            raise ConfigError(
                "fingerprint.block_bytes",
                fingerprint.block_bytes,
                f"the CPU rows' block size ({rowio.block_bytes} bytes)",
                "build the fingerprint with block_bytes=rows.shape[1]",
            )
        policy_class = get_policy_class(
            config.eviction, config.eviction_module_path, field=f"{field}.eviction"
        )
        stored_bytes = codec.max_encoded_bytes if codec is not None else rowio.block_bytes
        if codec is not None and not codec.fixed_size and not cls.sizes_blocks:
            logger.warning(
                "kvtier tier %s: codec %s on a %s tier saves bytes written and read, not room: "
                "each block keeps a raw block's slot (kind: files holds more blocks)",
                config.name,
                config.codec,
                cls.kind,
            )
        slot_bytes = on_disk_block_bytes(stored_bytes)
        capacity_blocks = config.capacity_bytes // slot_bytes
        if capacity_blocks < 1:
            raise ConfigError(
                f"{field}.capacity",
                format_size(config.capacity_bytes),
                f"room for at least one block: {format_size(slot_bytes)} on disk (a "
                f"{stored_bytes}-byte block rounded up to 4096-byte pages, plus its "
                f"4096-byte header)",
                f"raise the capacity to {slot_bytes} bytes or more",
            )
        assert config.path is not None  # _check_config refused a missing one
        directory = prepare_directory(config.path, field, read_only=read_only)
        claim_path(directory)
        locks = None
        tier = None
        dir_fd = -1
        try:
            # every file of the store is opened relative to this descriptor, never through a symlink
            dir_fd = open_store_directory(directory, field, config.path, read_only=read_only)
            locks = StoreLocks(dir_fd, directory, timeout_s=config.lock_timeout_s, read_only=read_only)
            _, created, wiped = settle_manifest(
                directory,
                cls.kind,
                cls.medium_names,
                config,
                fingerprint,
                locks.alone,
                field,
                read_only=read_only,
                stored_keys=cls.stored_keys,
                keep_keys=wiped_keys,
                # kvtier check (--fix too) reports keyed blocks it cannot verify, never drops them
                key_id=(keys.key_id if keys is not None else 0) if access == "serve" else None,
            )
            if read_only:
                direct, fallback = False, None  # the O_DIRECT probe writes a file
            else:
                direct, fallback = decide_direct(config, directory, rowio, field)
            tier = cls(
                config,
                rowio,
                fingerprint,
                capacity_blocks,
                directory,
                field,
                policy_class,
                threads if threads is not None else config.threads,
                direct,
                keys=keys,
                codec=codec,
            )
            tier._access = access
            tier._alone = locks.alone
            tier._wiped = wiped
            tier._store_fd, dir_fd = dir_fd, -1  # the tier's now: closed by close()
            if fallback is not None:
                tier._io.fall_back(fallback)
            started = time.perf_counter()
            entries = tier._open_medium(locks.alone, created)
            tier._build_index(entries)
            tier.open_s = time.perf_counter() - started
            locks.share()
            tier._locks = locks
            tier._start()
            logger.info(
                "kvtier tier %s: opened %s store %s: %d blocks of %d (%s%s), O_DIRECT %s, fsync %s, "
                "index in %.3f s%s",
                config.name,
                cls.kind,
                directory,
                len(tier._policy),
                capacity_blocks,
                format_size(capacity_blocks * slot_bytes),
                f", codec {codec.describe()}" if codec is not None else "",
                "on" if tier._io.direct else "off",
                config.fsync,
                tier.open_s,
                " (new)" if created else "",
            )
            return tier
        except BaseException as exc:
            if tier is not None:
                with contextlib.suppress(Exception):
                    tier._close_medium()
            if locks is not None:
                locks.close()
            if tier is not None and tier._store_fd >= 0:
                dir_fd, tier._store_fd = tier._store_fd, -1
            if dir_fd >= 0:
                os.close(dir_fd)
            release_path(directory)
            if isinstance(exc, OSError):
                raise ConfigError(
                    f"{field}.path",
                    config.path,
                    "a store directory kvtier can open",
                    store_os_fix(exc, directory),
                ) from None
            raise

    @classmethod
    def _check_config(cls, config: DiskTierConfig, field: str) -> None:
        if not isinstance(config, DiskTierConfig):
            raise ConfigError(
                field, type(config).__name__, "a DiskTierConfig (the section of lmdb and files)"
            )
        if config.kind != cls.kind:
            raise ConfigError(
                f"{field}.kind",
                config.kind,
                f"'{cls.kind}' for {cls.__name__}",
                "open the store with the class of its kind (kvtier.tiers.disk.get_store_class)",
            )
        if config.fsync not in FSYNC_CHOICES:
            raise ConfigError(f"{field}.fsync", config.fsync, "one of " + ", ".join(FSYNC_CHOICES))
        if config.o_direct not in O_DIRECT_CHOICES:
            raise ConfigError(f"{field}.o_direct", config.o_direct, "one of " + ", ".join(O_DIRECT_CHOICES))
        if not config.path:
            raise ConfigError(
                f"{field}.path",
                config.path,
                "a directory path",
                f"add path: such as {default_store_path(config.name)} (a directory of your own)",
            )

    def __init__(
        self,
        config: DiskTierConfig,
        rowio: RowIO,
        fingerprint: LayoutFingerprint,
        capacity_blocks: int,
        directory: str,
        field: str,
        policy_class: type[EvictionPolicy],
        threads: int,
        direct: bool,
        keys: TierKeys | None = None,
        codec: BlockCodec | None = None,
    ):
        """Use :meth:`open`."""
        #: the most bytes one block takes on disk: with a codec, room for the largest encoded
        #: block, so a tier of a fixed-size codec holds more blocks
        self.slot_bytes = on_disk_block_bytes(
            codec.max_encoded_bytes if codec is not None else rowio.block_bytes
        )
        sized = self.sizes_blocks and codec is not None and not codec.fixed_size
        #: bytes of the unit room is counted in: a page where blocks take their own size, else a slot
        self.unit_bytes = PAGE_BYTES if sized else self.slot_bytes
        # Blocks of their own size: the policy's figure bounds its ghost lists and shares
        # only, so twice the raw blocks (more than lossless's 1.4-1.5x on KV) rather than the
        # bytes over the smallest block (a bound that lets ghosts outgrow memory).
        super().__init__(
            config.name,
            rowio.block_bytes,
            capacity_blocks,
            policy_class(2 * capacity_blocks if sized else capacity_blocks),
            capacity_units=config.capacity_bytes // PAGE_BYTES if sized else None,
            block_units=self.slot_bytes // PAGE_BYTES if sized else 1,
        )
        self.config = config
        #: the store directory (absolute)
        self.path = directory
        self.fingerprint = fingerprint
        #: seconds the last open took to build the index
        self.open_s = 0.0
        self._field = field
        self._fsync = config.fsync
        self._threads = threads
        self._io = BlockIO(
            rowio,
            fingerprint.digest(),
            direct,
            self._counters,
            f"tier {config.name} at {directory}",
            keys=keys,
            codec=codec,
        )
        self._touched: set[OffloadKey] = set()
        # Blocks listed on the medium (mover thread) for this process to adopt (scheduler
        # thread, next poll); see IndexedTier._adopt_blocks. A plain attribute handed over
        # once: the GIL makes the assignment atomic.
        self._listed: list[tuple[OffloadKey, int, int]] | None = None
        self._listing = False
        self._mover: Mover | None = None
        self._locks: StoreLocks | None = None
        self._closed = False
        #: the store directory's descriptor: every file in it is opened relative to it
        self._store_fd = -1
        #: ``serve``, ``check`` or ``fix`` (see :meth:`open`)
        self._access = "serve"
        self._wiped = None
        #: no other process had the store open when this one opened it
        self._alone = False
        #: bytes the capacity exceeded the filesystem's room by at open (0: it fit)
        self.short_bytes = 0

    @property
    def read_only(self) -> bool:
        """Opened by ``kvtier check`` without ``--fix``: nothing on disk is written."""
        return self._access == "check"

    def _start(self) -> None:
        self._mover = Mover(self.name, self._threads)

    def _build_index(self, entries: list[tuple[OffloadKey, int, int]]) -> None:
        """Fill the policy from ``(key, recency stamp, block id)`` entries, oldest use first."""
        # newest first: a policy makes the first key of a call the most recent
        entries.sort(key=lambda entry: entry[1], reverse=True)
        self._insert([e[0] for e in entries], [e[2] for e in entries])

    # -- the medium, as IndexedTier sees it (scheduler thread; never waits) ----------------------

    def touch(self, keys: Collection[OffloadKey]) -> None:
        super().touch(keys)
        contains = self._policy.contains
        self._touched.update(key for key in keys if contains(key))
        if len(self._touched) >= _TOUCH_BATCH:
            keys_now, self._touched = list(self._touched), set()
            assert self._mover is not None  # open: it is None only before the start and once closed
            self._mover.submit_sequenced(partial(self._persist_stamps, keys_now, time.time_ns()))

    def _start_store(self, work: TierWork) -> None:
        touched, self._touched = list(self._touched), set()
        assert self._mover is not None  # jobs start only while open
        self._mover.submit(
            MoverJob(
                work.job_id,
                False,
                work.keys,
                work.rows,
                victims=work.victims,
                victim_ids=work.victim_ids,
                block=self._store_block,
                before=partial(self._store_before, touched=touched),
                after=self._after_store,
            )
        )

    def _start_load(self, work: TierWork) -> None:
        assert self._mover is not None  # jobs start only while open
        self._mover.submit(
            MoverJob(
                work.job_id,
                True,
                work.keys,
                work.rows,
                block_ids=work.block_ids,
                block=self._load_block,
                after=self._after_load,
            )
        )

    def _finished_work(self) -> Iterable[TierWork]:
        if self._mover is None:
            return ()
        if self._listed is not None:
            listed, self._listed = self._listed, None
            self._listing = False
            self._adopt_blocks(listed)
        return self._mover.poll()

    def _list_foreign_blocks(self) -> None:
        if not self._listing and self._mover is not None:
            self._listing = True
            self._mover.submit_sequenced(self._list_for_adoption)

    def drain_jobs(self) -> None:
        if self._mover is not None:
            self._mover.wait_idle()

    def wait_loads(self) -> None:
        if self._mover is not None:
            self._mover.wait_loads()

    def _medium_stats(self) -> dict[str, Any]:
        figures = {
            "bytes_written": 0,
            "bytes_read": 0,
            "o_direct_fallbacks": 0,
            "on_disk_block_bytes": self.slot_bytes,
            # what this process's blocks take on disk (headers included)
            "held_bytes": self._held_units * self.unit_bytes,
            "o_direct": int(self._io.direct),
            "short_bytes": self.short_bytes,
        }
        if self._io.codec is not None:
            # the ratio achieved: codec_block_bytes / codec_stored_bytes of the blocks written
            figures.update(codec_block_bytes=0, codec_stored_bytes=0)
        return figures

    @property
    def codec(self) -> BlockCodec | None:
        """The codec blocks are stored with (None: as they are)."""
        return self._io.codec

    def _note_room(self, needed_bytes: int) -> bool:
        """Whether the filesystem has ``needed_bytes`` more free for the capacity (caller's
        thread, at open). If not, the tier opens all the same, and says so once: a disk
        briefly full when the engine restarts costs the stores that find it full (failed as
        ``ENOSPC``, counted in ``failed_keys`` by reason), not the engine. ``kvtier config
        check`` reports the same as an error, before a deployment."""
        problem = room_problem(self.path, needed_bytes)
        if problem is None:
            return True
        self.short_bytes = needed_bytes - free_bytes(self.path)
        logger.warning(
            "kvtier tier %s: capacity %s does not fit in %s (%s); serving anyway: stores that "
            "find the disk full fail as ENOSPC, counted in failed_keys, until there is room "
            "(`kvtier config check` reports this as an error)",
            self.name,
            format_size(self.config.capacity_bytes),
            self.path,
            problem,
        )
        return False

    @property
    def o_direct(self) -> bool:
        """Whether blocks move with O_DIRECT now."""
        return self._io.direct

    @property
    def o_direct_fallback_reason(self) -> str:
        """Why O_DIRECT is not used (empty when it is, or when ``o_direct: off``)."""
        return self._io.fallback_reason

    def check(self, fix: bool = False) -> CheckReport:
        """Read and verify every block against the index; with ``fix``, drop what is bad.

        Blocks the calling thread for a full read of the store (it drains jobs first).
        """
        self.drain_jobs()
        report, dropped = self._check_medium(fix)
        self._forget(dropped)
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._mover is not None:
                if self._touched:
                    keys_now, self._touched = list(self._touched), set()
                    self._mover.submit_sequenced(partial(self._persist_stamps, keys_now, time.time_ns()))
                self._mover.close()
        finally:
            try:
                self._close_medium()
            finally:
                if self._locks is not None:
                    self._locks.close()
                if self._store_fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(self._store_fd)
                    self._store_fd = -1
                release_path(self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, {len(self._policy)}/{self.capacity_blocks} "
            f"blocks of {self.block_bytes} bytes)"
        )

    # -- mover-thread helpers -------------------------------------------------------------------

    def _list_for_adoption(self) -> None:
        """Sequencer: list the medium's blocks for :meth:`_adopt_blocks` (an empty list if that fails)."""
        try:
            self._listed = self._list_blocks()
        except Exception as exc:  # noqa: BLE001 - adoption is an optimisation: never fail a job for it
            logger.warning("kvtier tier %s: could not list the blocks of %s: %s", self.name, self.path, exc)
            self._listed = []

    def _after_store(self, job: MoverJob) -> None:
        self._store_after(job)
        written = [b for b, r, s in zip(job.block_ids, job.reasons, job.skip) if r is None and not s]
        self._counters.add("bytes_written", self._units(written) * self.unit_bytes)
        self._log_failures(job, "store")

    def _after_load(self, job: MoverJob) -> None:
        ok = [block_id for r, block_id in zip(job.reasons, job.block_ids) if r is None]
        self._counters.add("bytes_read", self._units(ok) * self.unit_bytes)
        self._log_failures(job, "load")

    def _log_failures(self, job: MoverJob, what: str) -> None:
        """One line per failed job (corrupt blocks are logged one by one where dropped)."""
        reasons: dict[str, int] = {}
        for reason in job.reasons:
            if reason is not None and reason.kind not in _QUIET:
                text = str(reason)
                reasons[text] = reasons.get(text, 0) + 1
        if reasons:
            self._counters.add("jobs_failed")
            summary = ", ".join(f"{count} x {reason}" for reason, count in sorted(reasons.items()))
            logger.warning(
                "kvtier tier %s: %s job %d: %d of %d blocks failed (%s) in %s; those blocks are "
                "not served, committed blocks are untouched",
                self.name,
                what,
                job.job_id,
                sum(reasons.values()),
                len(job.keys),
                summary,
                self.path,
            )

    def _log_corrupt(self, key: OffloadKey, reason: Failure, where: str) -> None:
        logger.warning(
            "kvtier tier %s: block %s at %s failed verification (%s): dropped, not served",
            self.name,
            key.hex(),
            where,
            reason.detail,
        )

    # -- medium hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _open_medium(self, alone: bool, created: bool) -> list[tuple[OffloadKey, int, int]]:
        """Open the medium (caller's thread; blocks); the index as ``(key, stamp, block id)``.

        ``alone``: no other process has the store open, so leftovers of crashed processes may
        be recovered and the capacity applied. ``created``: the store is new (or was wiped).
        """

    @abstractmethod
    def _store_before(self, job: MoverJob, *, touched: list[OffloadKey]) -> None:
        """Sequencer: remove ``job.victims`` from the medium, persist ``touched`` recency,
        reserve room for ``job.keys`` (``skip`` those already on disk, fail with
        ``Failure.FULL`` those that do not fit), and set ``job.shared_units`` (the room the
        medium's blocks take, all processes) and ``job.refused``."""

    @abstractmethod
    def _store_block(self, job: MoverJob, index: int) -> Failure | None:
        """I/O thread: write key ``index`` of ``job``; ``None`` or the failure."""

    @abstractmethod
    def _store_after(self, job: MoverJob) -> None:
        """The job's last I/O thread: make the written blocks durable (per ``fsync``) and
        visible, release what failed; may fail keys."""

    @abstractmethod
    def _load_block(self, job: MoverJob, index: int) -> Failure | None:
        """I/O thread: read key ``index`` of ``job`` into its row and verify it; a corrupt block
        is dropped from the medium and logged; ``None`` or the failure (``MISSING``,
        ``Failure.corrupt(<check>)``, an OS error)."""

    @abstractmethod
    def _persist_stamps(self, keys: list[OffloadKey], stamp: int) -> None:
        """Sequencer: record that ``keys`` were used at ``stamp`` (ns since the epoch)."""

    @abstractmethod
    def _list_blocks(self) -> list[tuple[OffloadKey, int, int]]:
        """Sequencer: every block on the medium now, as ``(key, stamp, block id)`` (all processes')."""

    @abstractmethod
    def _check_medium(self, fix: bool) -> tuple[CheckReport, list[OffloadKey]]:
        """Caller's thread (jobs drained): verify everything; the report and keys to forget."""

    @abstractmethod
    def _close_medium(self) -> None:
        """Caller's thread: release files and handles. Idempotent."""

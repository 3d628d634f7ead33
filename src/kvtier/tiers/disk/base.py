"""What the two disk tiers (``lmdb``, ``files``) share: opening a store, the scheduler-side
index and eviction, job bookkeeping, block I/O with verification, and the store's locks.

A disk tier is split along the thread boundary the contract draws
(:class:`~kvtier.tiers.base.SecondaryTier`):

* **scheduler thread** — :meth:`DiskTier.lookup`, ``touch``, ``submit_*``,
  ``get_finished_jobs`` ... work on in-memory state only: an eviction policy (key -> block
  id, in eviction order), the keys being written and read, pending jobs, events. They never
  wait for I/O; they hand :class:`~kvtier.tiers.disk.mover.MoverJob` objects to the mover.
* **mover threads** — the medium's hooks (``_store_before``, ``_store_block``,
  ``_store_after``, ``_load_block`` ...) do the I/O and the on-disk index, and report per-key
  reasons. They never touch the scheduler-side state; the scheduler folds their results in
  when it polls.

The on-disk state is the truth shared by every process using the path; each process's
in-memory policy is its view of it, built at open (so a restart finds every committed block)
and kept in step by its own jobs. Loads always re-resolve a key on disk, and every block read
is verified, so a view made stale by another process costs a miss, never wrong bytes.

Opening a store (:meth:`DiskTier.open`), in order: check the configuration and the directory
(created if its parent exists; a clear :class:`~kvtier.errors.ConfigError` for a missing
parent, a file in the way, a read-only or unwritable directory, a non-kvtier directory that is
not empty); take the store's maintenance lock and learn whether any other process has the
store open; read or write the manifest; wipe the store if it holds another layout (only when
no other process uses it); probe O_DIRECT; open the medium and build the index.

Two lock files coordinate processes (``flock``, released by the kernel if a process dies):
``kvtier-store.lock`` is held exclusively only while a process opens the store, and every
process that has the store open holds ``kvtier-users.lock`` shared. An opener that gets
``kvtier-users.lock`` exclusively is *alone*: it may recover what crashed processes left (slot
reservations, temp files), reconcile counters, resize, or wipe. (Rejected: pid files — a pid
is reused, and a crashed process leaves its file behind; a kernel lock cannot leak.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from abc import abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar, TypeVar

import numpy as np
import xxhash

from kvtier.base import LoadStoreSpec, OffloadingEvent, OffloadKey
from kvtier.config import FSYNC_CHOICES, O_DIRECT_CHOICES, DiskTierConfig, format_size
from kvtier.errors import ConfigError, KvtierError
from kvtier.policies import EvictionPolicy, get_policy_class
from kvtier.tiers.base import CheckReport, SecondaryTier, TierJob, TierJobResult
from kvtier.tiers.disk.format import (
    HEADER_BYTES,
    LayoutFingerprint,
    encode_header_into,
    on_disk_block_bytes,
    verify,
)
from kvtier.tiers.disk.manifest import (
    MANIFEST_NAME,
    ManifestError,
    StoreManifest,
    read_manifest,
    write_manifest,
)
from kvtier.tiers.disk.mover import (
    DEFAULT_THREADS,
    Mover,
    MoverJob,
    RowIO,
    aligned_buffer,
    errno_reason,
    probe_o_direct,
    scratch_page,
)

__all__ = ["DiskLoadStoreSpec", "DiskTier", "DiskTierError", "pid_alive"]

logger = logging.getLogger(__name__)

_Tier = TypeVar("_Tier", bound="DiskTier")
_MAINTENANCE_LOCK = "kvtier-store.lock"
_USERS_LOCK = "kvtier-users.lock"
# Names an opener may find in a directory that is not a store yet: its own lock files (left by
# an opener that crashed before writing the manifest) and probe files.
_OWN_PREFIXES = (".kvtier-",)
_OWN_NAMES = (_MAINTENANCE_LOCK, _USERS_LOCK)
_TRASH_PREFIX = ".kvtier-trash-"
# touch() persists recency in batches of this many keys (and at close): per-touch writes would
# put a disk write on every cache hit, and recency is only a hint for eviction after restart.
_TOUCH_BATCH = 4096

# Paths open in this process. LMDB forbids opening one environment twice in a process (its
# fcntl locks are per process, so the second close would drop the first's locks), and two
# in-process tiers on one path would each believe they own the capacity.
_open_lock = threading.Lock()
_open_paths: set[str] = set()


class DiskTierError(KvtierError):
    """A disk tier cannot be used as asked for a reason that is not one configuration value."""


class DiskLoadStoreSpec(LoadStoreSpec):
    """Blocks of a disk tier, named by their keys (the tier resolves where they lie)."""

    def __init__(self, keys: Iterable[OffloadKey]):
        self.keys = tuple(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.keys)} keys)"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _os_fix(exc: OSError, where: str) -> str:
    """How to fix an OSError met while preparing ``where``."""
    if exc.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem: remount it read-write or choose a path on a writable disk"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"this user (uid {os.getuid()}) may not write in {where}: fix its ownership or "
            f"permissions, or choose another path"
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the filesystem of {where} is full: free space there or choose another disk"
    return f"fix {where} ({exc.strerror})"


@dataclass
class _Pending:
    """A submitted job's bookkeeping on the scheduler side, until its result is polled."""

    job: TierJob
    is_load: bool
    ok: list[OffloadKey]
    failed: dict[OffloadKey, str]
    submitted_s: float


class _StoreLocks:
    """The maintenance and users locks of one store directory (see the module docstring)."""

    def __init__(self, directory: str):
        self._maintenance = os.open(os.path.join(directory, _MAINTENANCE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._maintenance, fcntl.LOCK_EX)  # held for the few ms of an open
            self._users = os.open(os.path.join(directory, _USERS_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except BaseException:
            os.close(self._maintenance)
            raise
        try:
            fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            #: no other process has the store open
            self.alone = True
        except BlockingIOError:
            self.alone = False

    def share(self) -> None:
        """Become an ordinary user and let the next opener in.

        Converting EX to SH is not atomic in flock, but nobody can observe the gap: every
        opener takes the maintenance lock, which is released only afterwards.
        """
        fcntl.flock(self._users, fcntl.LOCK_SH)
        fcntl.flock(self._maintenance, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._maintenance, self._users):
            with contextlib.suppress(OSError):
                os.close(fd)


class _Skip:
    """Keys an eviction must pass over: those being read and those of the store's own offer."""

    __slots__ = ("offered", "reading")

    def __init__(self, reading: Collection[OffloadKey], offered: Collection[OffloadKey]):
        self.reading = reading
        self.offered = offered

    def __contains__(self, key: object) -> bool:
        return key in self.reading or key in self.offered


@dataclass
class _Counters:
    """Counters written by any thread (under ``lock``), read by :meth:`DiskTier.stats`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.values)


def _reason_counter(prefix: str, reason: str) -> str:
    """``failed_ENOSPC``, ``corrupt_other_key`` ...: a stats key for a failure reason."""
    text = reason.removeprefix("corrupt: ").replace(": ", "_").replace(" ", "_")
    return f"{prefix}_{text}"


class DiskTier(SecondaryTier):
    """The part of a disk tier that is the same for every medium (see the module docstring).

    Subclasses set :attr:`kind`, :attr:`medium`, :attr:`max_key_bytes` and
    :attr:`medium_names`, and implement the medium hooks (``_open_medium`` ... ``_close_medium``),
    which run on mover threads except ``_open_medium``/``_check_medium``/``_close_medium``
    (caller's thread, blocking by design).
    """

    #: the configuration ``kind`` this class serves
    kind: ClassVar[str] = ""
    #: the longest key the medium stores
    max_key_bytes: ClassVar[int] = 0
    #: entries of the store directory that belong to the medium (removed when wiping)
    medium_names: ClassVar[tuple[str, ...]] = ()
    #: the LoadStoreSpec class of the medium
    spec_class: ClassVar[type[DiskLoadStoreSpec]] = DiskLoadStoreSpec

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        config: DiskTierConfig,
        rows: np.ndarray,
        fingerprint: LayoutFingerprint,
        *,
        field: str = "tiers[1]",
        threads: int | None = None,
    ) -> DiskTier:
        """Open (creating if need be) the store at ``config.path`` for CPU rows ``rows``.

        ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view that jobs copy from
        and into; ``fingerprint`` describes what the bytes are. Called once, by whoever builds
        the tier stack, on its own thread; blocks for the directory checks, the lock, the
        index scan (~0.1-0.5 s per 100,000 blocks) and, for a new store, its creation.
        Raises :class:`ConfigError` naming ``<field>.<key>`` for anything the configuration
        or the directory gets wrong, with the fix.
        """
        cls._check_config(config, field)
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
        slot_bytes = on_disk_block_bytes(rowio.block_bytes)
        capacity_blocks = config.capacity_bytes // slot_bytes
        if capacity_blocks < 1:
            raise ConfigError(
                f"{field}.capacity",
                format_size(config.capacity_bytes),
                f"room for at least one block: {format_size(slot_bytes)} on disk (a "
                f"{rowio.block_bytes}-byte block rounded up to 4096-byte pages, plus its "
                f"4096-byte header)",
                f"raise the capacity to {slot_bytes} bytes or more",
            )
        directory = cls._prepare_directory(config.path, field)
        with _open_lock:
            if directory in _open_paths:
                raise DiskTierError(
                    f"{directory} is already open as a disk tier in this process; share that "
                    f"tier object, or close it before opening the path again"
                )
            _open_paths.add(directory)
        locks = None
        tier = None
        try:
            locks = _StoreLocks(directory)
            _, created = cls._settle_manifest(
                directory, config, fingerprint, locks.alone, field
            )
            direct, fallback = cls._decide_direct(config, directory, rowio, field)
            tier = cls(
                config, rowio, fingerprint, capacity_blocks, directory, field, policy_class,
                threads if threads is not None else DEFAULT_THREADS, direct,
            )
            if fallback is not None:
                tier._direct_fallback(fallback)
            started = time.perf_counter()
            entries = tier._open_medium(locks.alone, created)
            tier._build_index(entries)
            tier.open_s = time.perf_counter() - started
            locks.share()
            tier._locks = locks
            tier._start()
            logger.info(
                "kvtier tier %s: opened %s store %s: %d blocks of %d (%s), O_DIRECT %s, fsync %s, "
                "index in %.3f s%s",
                config.name, cls.kind, directory, len(tier._policy), capacity_blocks,
                format_size(capacity_blocks * slot_bytes), "on" if tier._direct else "off",
                config.fsync, tier.open_s, " (new)" if created else "",
            )
            return tier
        except BaseException:
            if tier is not None:
                with contextlib.suppress(Exception):
                    tier._close_medium()
            if locks is not None:
                locks.close()
            with _open_lock:
                _open_paths.discard(directory)
            raise

    @classmethod
    def _check_config(cls, config: DiskTierConfig, field: str) -> None:
        if not isinstance(config, DiskTierConfig):
            raise ConfigError(field, type(config).__name__, "a DiskTierConfig (a tier of kind lmdb or files)")
        if config.kind != cls.kind:
            raise ConfigError(
                f"{field}.kind", config.kind, f"'{cls.kind}' for {cls.__name__}",
                "open the store with the class of its kind (kvtier.tiers.disk.get_store_class)",
            )
        if config.fsync not in FSYNC_CHOICES:
            raise ConfigError(f"{field}.fsync", config.fsync, "one of " + ", ".join(FSYNC_CHOICES))
        if config.o_direct not in O_DIRECT_CHOICES:
            raise ConfigError(f"{field}.o_direct", config.o_direct, "one of " + ", ".join(O_DIRECT_CHOICES))
        if not config.path:
            raise ConfigError(f"{field}.path", config.path, "a directory path", "add path: such as /var/tmp/kvtier")

    @classmethod
    def _prepare_directory(cls, path: str, field: str) -> str:
        """The store's absolute path, created if its parent exists and proven writable."""
        directory = os.path.abspath(os.path.expanduser(path))
        where = f"{field}.path"
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise ConfigError(
                where, path, "a directory (or where to create one)",
                f"{directory} is a file: point path at a directory",
            )
        if not os.path.isdir(directory):
            parent = os.path.dirname(directory)
            if not os.path.isdir(parent):
                raise ConfigError(
                    where, path, "a directory whose parent exists",
                    f"create {parent} first (kvtier creates only the last path component)",
                )
            try:
                os.mkdir(directory, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ConfigError(where, path, "a directory kvtier can create", _os_fix(exc, parent)) from None
        probe = os.path.join(directory, f".kvtier-write-probe-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"kvtier")
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(probe)
            raise ConfigError(where, path, "a directory kvtier can write", _os_fix(exc, directory)) from None
        # the real path: one store reached through a symlink is still one store
        return os.path.realpath(directory)

    @classmethod
    def _settle_manifest(
        cls,
        directory: str,
        config: DiskTierConfig,
        fingerprint: LayoutFingerprint,
        alone: bool,
        field: str,
    ) -> tuple[StoreManifest, bool]:
        """Read, create or replace the manifest; ``(manifest, created)``. Under the maintenance lock."""
        try:
            manifest = read_manifest(directory)
        except ManifestError as exc:
            raise ConfigError(f"{field}.path", config.path, "a kvtier store or an empty directory", str(exc)) from None
        if manifest is None:
            foreign = [
                name for name in os.listdir(directory)
                if name not in _OWN_NAMES and not name.startswith(_OWN_PREFIXES)
            ]
            if foreign:
                shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
                raise ConfigError(
                    f"{field}.path", config.path,
                    "an empty directory or a kvtier store (it has no kvtier-store.json)",
                    f"it holds other files ({shown}); kvtier never deletes files it did not "
                    f"write: choose an empty or new directory",
                )
            manifest = StoreManifest.new(cls.kind, fingerprint, config.capacity_bytes)
            cls._write_manifest(directory, manifest, config, field)
            return manifest, True
        if manifest.kind != cls.kind:
            raise ConfigError(
                f"{field}.kind", config.kind,
                f"'{manifest.kind}': {directory} holds a {manifest.kind} store",
                f"set kind: {manifest.kind}, or point path at another directory (or remove "
                f"{directory} to start a {cls.kind} store there)",
            )
        if manifest.fingerprint.digest() != fingerprint.digest():
            if not alone:
                raise ConfigError(
                    f"{field}.path", config.path,
                    "a store of this engine's layout, or one no other process is using",
                    f"another process uses {directory} with layout ({manifest.fingerprint.describe()}), "
                    f"this one is ({fingerprint.describe()}): give each layout its own path",
                )
            # Wiped rather than moved aside: a cache is recomputable, nothing would ever read
            # an aside copy back, and keeping it would hold disk space outside any capacity
            # (each model switch would leave another copy, until the disk is full).
            logger.warning(
                "kvtier tier %s: %s holds blocks of another layout (%s); this engine's layout is "
                "(%s). Serving none of them: wiping the old blocks and starting empty.",
                config.name, directory, manifest.fingerprint.describe(), fingerprint.describe(),
            )
            cls._wipe(directory)
            manifest = StoreManifest.new(cls.kind, fingerprint, config.capacity_bytes)
            cls._write_manifest(directory, manifest, config, field)
            return manifest, True
        if manifest.capacity_bytes != config.capacity_bytes:
            if not alone:
                raise ConfigError(
                    f"{field}.capacity", format_size(config.capacity_bytes),
                    f"{format_size(manifest.capacity_bytes)}, the capacity another process "
                    f"uses {directory} with",
                    "give every process sharing a path the same capacity (or its own path)",
                )
            manifest = StoreManifest(
                manifest.kind, manifest.format_version, manifest.fingerprint,
                config.capacity_bytes, manifest.created_s,
            )
            cls._write_manifest(directory, manifest, config, field)
        if alone:
            cls._remove_trash(directory)
        return manifest, False

    @classmethod
    def _write_manifest(cls, directory: str, manifest: StoreManifest, config: DiskTierConfig, field: str) -> None:
        try:
            write_manifest(directory, manifest)
        except OSError as exc:
            raise ConfigError(f"{field}.path", config.path, "a directory kvtier can write", _os_fix(exc, directory)) from None

    @classmethod
    def _wipe(cls, directory: str) -> None:
        """Remove the medium's entries: first renamed into one trash directory (atomic, so a
        crash mid-way never leaves half a store under the live names), then deleted."""
        trash = os.path.join(directory, f"{_TRASH_PREFIX}{secrets.token_hex(4)}")
        os.mkdir(trash)
        for name in cls.medium_names:
            source = os.path.join(directory, name)
            if os.path.lexists(source):
                os.rename(source, os.path.join(trash, name))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, MANIFEST_NAME))
        shutil.rmtree(trash, ignore_errors=True)

    @classmethod
    def _remove_trash(cls, directory: str) -> None:
        for name in os.listdir(directory):
            if name.startswith(_TRASH_PREFIX):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    @classmethod
    def _decide_direct(
        cls, config: DiskTierConfig, directory: str, rowio: RowIO, field: str
    ) -> tuple[bool, str | None]:
        """``(use O_DIRECT, why it falls back)`` per ``o_direct``; ``on`` that cannot be is an error."""
        if config.o_direct == "off":
            return False, None
        probe = probe_o_direct(directory)
        problem = probe.reason if not probe.supported else rowio.direct_problem
        if problem is None:
            return True, None
        if config.o_direct == "on":
            raise ConfigError(
                f"{field}.o_direct", "on", f"O_DIRECT usable in {config.path}",
                f"{problem}: set o_direct: auto (falls back to buffered I/O, logged) or off, "
                f"or put the store on a filesystem that supports O_DIRECT",
            )
        return False, problem

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
    ):
        """Use :meth:`open`."""
        super().__init__(config.name, rowio.block_bytes, capacity_blocks)
        self.config = config
        #: the store directory (absolute)
        self.path = directory
        self.fingerprint = fingerprint
        #: bytes one block takes on disk (capacity is counted in these)
        self.slot_bytes = on_disk_block_bytes(rowio.block_bytes)
        #: seconds the last open took to build the index
        self.open_s = 0.0
        self._field = field
        self._rowio = rowio
        self._digest = fingerprint.digest()
        self._fsync = config.fsync
        self._direct = direct
        self._threads = threads
        self._direct_reason = ""
        self._policy = policy_class(capacity_blocks)
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}
        self._touched: set[OffloadKey] = set()
        self._pending: dict[int, _Pending] = {}
        self._ready: list[TierJobResult] = []
        self._events: list[OffloadingEvent] = []
        # Blocks other processes hold in a shared store, as last seen when the medium had to
        # refuse room (0 while this process is the only writer; see _complete_store).
        self._foreign_blocks = 0
        # Blocks listed on the medium (mover thread) for this process to adopt (scheduler
        # thread, next poll); see _adopt_blocks. A plain attribute handed over once: the GIL
        # makes the assignment atomic.
        self._listed: list[tuple[OffloadKey, int, int]] | None = None
        self._listing = False
        self._counters = _Counters()
        self._warned: set[str] = set()
        self._mover: Mover | None = None
        self._locks: _StoreLocks | None = None
        self._closed = False

    def _start(self) -> None:
        self._mover = Mover(self.name, self._threads)

    def _build_index(self, entries: list[tuple[OffloadKey, int, int]]) -> None:
        """Fill the policy from ``(key, recency stamp, block id)`` entries, oldest use first."""
        entries.sort(key=lambda entry: entry[1])
        self._policy.insert([e[0] for e in entries], [e[2] for e in entries])

    # -- the contract (scheduler thread; never waits for I/O) ----------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        if self._policy.contains(key):
            return True
        return None if key in self._writing else False

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self._policy.touch(keys)
        contains = self._policy.contains
        self._touched.update(key for key in keys if contains(key))
        if len(self._touched) >= _TOUCH_BATCH:
            keys_now, self._touched = list(self._touched), set()
            self._mover.submit_sequenced(partial(self._persist_stamps, keys_now, time.time_ns()))

    def submit_store(self, job: TierJob) -> None:
        policy = self._policy
        ok: list[OffloadKey] = []
        failed: dict[OffloadKey, str] = {}
        new_keys: list[OffloadKey] = []
        new_rows: list[int] = []
        for key, row in zip(job.keys, job.rows):
            if policy.contains(key) or key in self._writing:
                ok.append(key)
            elif len(key) > self.max_key_bytes:
                failed[key] = "key too long"
            else:
                new_keys.append(key)
                new_rows.append(row)
        victims: list[OffloadKey] = []
        if new_keys:
            room = self.capacity_blocks - len(policy) - len(self._writing) - self._foreign_blocks
            if len(new_keys) > room:
                victims = self._evict(len(new_keys) - room, set(job.keys))
                room += len(victims)
            room = max(room, 0)
            for key in new_keys[room:]:
                failed[key] = "full"
            del new_keys[room:], new_rows[room:]
        if victims:
            self._counters.add("evicted", len(victims))
            self._events.append(OffloadingEvent(victims, self.block_bytes, self.medium, True))
        pending = _Pending(job, False, ok, failed, time.perf_counter())
        if not new_keys and not victims:
            self._ready.append(self._result(pending))
            return
        self._writing.update(new_keys)
        touched, self._touched = list(self._touched), set()
        self._pending[job.job_id] = pending
        self._mover.submit(
            MoverJob(
                job.job_id, False, new_keys, new_rows,
                block=self._store_block,
                before=partial(self._store_before, victims=victims, touched=touched),
                after=self._after_store,
            )
        )

    def submit_load(self, job: TierJob) -> None:
        reading = self._reading
        for key in job.keys:
            reading[key] = reading.get(key, 0) + 1
        self._pending[job.job_id] = _Pending(job, True, [], {}, time.perf_counter())
        mover_job = MoverJob(
            job.job_id, True, list(job.keys), list(job.rows),
            block=self._load_block, after=self._after_load,
        )
        get = self._policy.get
        mover_job.block_ids = [get(key) or 0 for key in job.keys]
        self._mover.submit(mover_job)

    def get_finished_jobs(self) -> list[TierJobResult]:
        results, self._ready = self._ready, []
        if self._mover is None:
            return results
        if self._listed is not None:
            listed, self._listed = self._listed, None
            self._listing = False
            self._adopt_blocks(listed)
        for mover_job in self._mover.poll():
            pending = self._pending.pop(mover_job.job_id)
            if pending.is_load:
                results.append(self._complete_load(pending, mover_job))
            else:
                results.append(self._complete_store(pending, mover_job))
        return results

    def drain_jobs(self) -> None:
        if self._mover is not None:
            self._mover.wait_idle()

    def has_pending_work(self) -> bool:
        return bool(self._pending) or bool(self._ready)

    def num_blocks(self) -> int:
        return len(self._policy)

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        figures = {
            "stored": 0, "loaded": 0, "evicted": 0, "failed_keys": 0, "corrupt": 0,
            "missing": 0, "bytes_written": 0, "bytes_read": 0, "o_direct_fallbacks": 0,
        }
        figures.update(self._counters.snapshot())
        figures.update(
            blocks=len(self._policy),
            capacity_blocks=self.capacity_blocks,
            block_bytes=self.block_bytes,
            on_disk_block_bytes=self.slot_bytes,
            o_direct=int(self._direct),
            jobs_in_flight=len(self._pending),
        )
        return figures

    @property
    def o_direct(self) -> bool:
        """Whether blocks move with O_DIRECT now."""
        return self._direct

    @property
    def o_direct_fallback_reason(self) -> str:
        """Why O_DIRECT is not used (empty when it is, or when ``o_direct: off``)."""
        return self._direct_reason

    def load_store_spec(self, keys: Iterable[OffloadKey]) -> DiskLoadStoreSpec:
        """A spec naming ``keys`` on this medium."""
        return self.spec_class(keys)

    def check(self, fix: bool = False) -> CheckReport:
        """Read and verify every block against the index; with ``fix``, drop what is bad.

        Blocks the calling thread for a full read of the store (it drains jobs first).
        """
        self.drain_jobs()
        report, dropped = self._check_medium(fix)
        removed = [key for key in dropped if self._policy.remove(key) is not None]
        if removed:
            self._events.append(OffloadingEvent(removed, self.block_bytes, self.medium, True))
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
                with _open_lock:
                    _open_paths.discard(self.path)

    def __enter__(self: _Tier) -> _Tier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, {len(self._policy)}/{self.capacity_blocks} "
            f"blocks of {self.block_bytes} bytes)"
        )

    # -- scheduler-side helpers -----------------------------------------------------------------

    def _evict(self, count: int, offered: set[OffloadKey]) -> list[OffloadKey]:
        """Up to ``count`` victims in policy order, sparing keys being read and the offer."""
        policy = self._policy
        contains = policy.contains
        protected = sum(1 for key in offered if contains(key))
        protected += sum(1 for key in self._reading if key not in offered and contains(key))
        count = min(count, len(policy) - protected)
        if count <= 0:
            return []
        chosen = policy.evict(count, _Skip(self._reading, offered))
        return [key for key, _ in chosen] if chosen else []

    def _result(self, pending: _Pending) -> TierJobResult:
        result = TierJobResult(pending.job.job_id, pending.is_load, ok=pending.ok, failed=pending.failed)
        result.seconds = time.perf_counter() - pending.submitted_s
        if result.failed:
            self._counters.add("failed_keys", len(result.failed))
            for reason in result.failed.values():
                self._counters.add(_reason_counter("failed", reason))
        return result

    def _complete_store(self, pending: _Pending, job: MoverJob) -> TierJobResult:
        stored: list[OffloadKey] = []
        block_ids: list[int] = []
        for key, reason, block_id in zip(job.keys, job.reasons, job.block_ids):
            self._writing.discard(key)
            if reason is None:
                stored.append(key)
                block_ids.append(block_id)
            else:
                pending.failed[key] = reason
        if stored:
            self._policy.insert(stored, block_ids)
            pending.ok.extend(stored)
            self._events.append(OffloadingEvent(stored, self.block_bytes, self.medium, False))
            self._counters.add("stored", len(stored))
        shared = job.extra.get("shared_blocks")
        if shared is not None:
            own = len(self._policy) + len(self._writing)
            foreign = max(0, shared - own)
            # Only a refusal by the medium proves that other processes fill the store; without
            # one, an estimate can only shrink (this process's in-flight evictions would
            # otherwise look like foreign blocks and cause needless evictions).
            if job.extra.get("refused"):
                self._foreign_blocks = foreign
                if not self._listing and len(self._policy) < self.capacity_blocks // 2:
                    # Other processes fill the store and this one holds too few blocks to make
                    # room by evicting its own: it could never store again, even after they
                    # exit. Learn their blocks so that eviction can take them too.
                    self._listing = True
                    self._mover.submit_sequenced(self._list_for_adoption)
            else:
                self._foreign_blocks = min(self._foreign_blocks, foreign)
        result = self._result(pending)
        result.nbytes = len(stored) * self.block_bytes
        return result

    def _complete_load(self, pending: _Pending, job: MoverJob) -> TierJobResult:
        reading = self._reading
        dropped: list[OffloadKey] = []
        for key, reason in zip(job.keys, job.reasons):
            count = reading.pop(key)
            if count > 1:
                reading[key] = count - 1
            if reason is None:
                pending.ok.append(key)
                continue
            pending.failed[key] = reason
            dropped_on_disk = reason == "missing" or reason.startswith("corrupt")
            if dropped_on_disk and self._policy.remove(key) is not None:
                dropped.append(key)
        if dropped:
            self._events.append(OffloadingEvent(dropped, self.block_bytes, self.medium, True))
        self._counters.add("loaded", len(pending.ok))
        result = self._result(pending)
        result.nbytes = len(pending.ok) * self.block_bytes
        return result

    def _adopt_blocks(self, listed: list[tuple[OffloadKey, int, int]]) -> None:
        """Make blocks other processes stored known here, as the coldest (so evicted first).

        Rebuilds the policy (adopted blocks oldest stamp first, then this process's own in
        their eviction order): it runs only when the medium refused room and this process
        holds under half the store, so a rebuild per such event is cheap enough.
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
        policy.insert([e[0] for e in adopted], [e[2] for e in adopted])
        if own:
            policy.insert([key for key, _ in own], [block_id for _, block_id in own])
        self._foreign_blocks = max(0, self._foreign_blocks - len(adopted))
        self._counters.add("adopted", len(adopted))

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
        written = sum(1 for r, s in zip(job.reasons, job.skip) if r is None and not s)
        self._counters.add("bytes_written", written * self.slot_bytes)
        self._log_failures(job, "store")

    def _after_load(self, job: MoverJob) -> None:
        ok = sum(1 for r in job.reasons if r is None)
        self._counters.add("bytes_read", ok * self.slot_bytes)
        for reason in job.reasons:
            if reason is None:
                continue
            if reason == "missing":
                self._counters.add("missing")
            elif reason.startswith("corrupt"):
                self._counters.add("corrupt")
                self._counters.add(_reason_counter("corrupt", reason))
        self._log_failures(job, "load")

    def _log_failures(self, job: MoverJob, what: str) -> None:
        """One line per failed job (corrupt blocks are logged one by one where dropped)."""
        reasons: dict[str, int] = {}
        for reason in job.reasons:
            if reason is not None and not reason.startswith("corrupt") and reason not in ("missing", "full"):
                reasons[reason] = reasons.get(reason, 0) + 1
        if reasons:
            self._counters.add("jobs_failed")
            summary = ", ".join(f"{count} x {reason}" for reason, count in sorted(reasons.items()))
            logger.warning(
                "kvtier tier %s: %s job %d: %d of %d blocks failed (%s) in %s; those blocks are "
                "not served, committed blocks are untouched",
                self.name, what, job.job_id, sum(reasons.values()), len(job.keys), summary, self.path,
            )

    def _log_corrupt(self, key: OffloadKey, reason: str, where: str) -> None:
        logger.warning(
            "kvtier tier %s: block %s at %s failed verification (%s): dropped, not served",
            self.name, key.hex(), where, reason,
        )

    def _direct_fallback(self, reason: str) -> None:
        """Stop using O_DIRECT (any thread): logged once, counted once."""
        with self._counters.lock:
            if self._direct_reason:
                self._direct = False
                return  # another thread fell back first
            self._direct = False
            self._direct_reason = reason
        self._counters.add("o_direct_fallbacks")
        logger.warning(
            "kvtier tier %s: O_DIRECT not used for %s (%s); falling back to buffered I/O, "
            "which costs page-cache copies and memory",
            self.name, self.path, reason,
        )

    def _write_block(self, fd: int, offset: int, key: OffloadKey, row: int, direct: bool) -> None:
        """Write ``key``'s block from CPU row ``row`` at ``offset`` of ``fd``: header page + row.

        One ``pwritev`` straight from the row (no staging copy). Raises ``OSError``; a short
        write on a regular file means the filesystem ran out of room, reported as ENOSPC.
        """
        page = scratch_page()
        rowio = self._rowio
        encode_header_into(
            page, layout_digest=self._digest, key=key, payload_bytes=self.block_bytes,
            checksum=xxhash.xxh3_64_intdigest(rowio.payload(row)),
        )
        iov = rowio.iov(row, direct)
        expected = HEADER_BYTES + len(iov)
        written = os.pwritev(fd, [page, iov], offset)
        if written != expected:
            raise OSError(errno.ENOSPC, f"short write: {written} of {expected} bytes")

    def _read_block(self, fd: int, offset: int, key: OffloadKey, row: int, direct: bool) -> str | None:
        """Read the block at ``offset`` of ``fd`` straight into CPU row ``row`` and verify it there.

        Returns ``None`` if the row now holds ``key``'s block, else the reason. Raises ``OSError``.
        """
        page = scratch_page()
        rowio = self._rowio
        nread = os.preadv(fd, [page, rowio.iov(row, direct)], offset)
        return verify(
            page, rowio.payload(row), nread, key=key, layout_digest=self._digest,
            payload_bytes=self.block_bytes,
        )

    def _check_buffer(self) -> tuple[object, np.ndarray]:
        """A private header page and a padded payload buffer for :meth:`check` reads."""
        page = aligned_buffer(HEADER_BYTES)
        payload = aligned_buffer(self._rowio.padded_bytes)
        return page, np.frombuffer(payload, dtype=np.uint8)

    def _read_for_check(self, fd: int, offset: int, key: OffloadKey, page, payload: np.ndarray) -> str | None:
        """Read and verify one block into check buffers (caller's thread); reason or None."""
        try:
            nread = os.preadv(fd, [page, payload], offset)
        except OSError as exc:
            return errno_reason(exc)
        return verify(
            page, payload[: self.block_bytes], nread, key=key, layout_digest=self._digest,
            payload_bytes=self.block_bytes,
        )

    # -- medium hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _open_medium(self, alone: bool, created: bool) -> list[tuple[OffloadKey, int, int]]:
        """Open the medium (caller's thread; blocks); the index as ``(key, stamp, block id)``.

        ``alone``: no other process has the store open, so leftovers of crashed processes may
        be recovered and the capacity applied. ``created``: the store is new (or was wiped).
        """

    @abstractmethod
    def _store_before(self, job: MoverJob, *, victims: list[OffloadKey], touched: list[OffloadKey]) -> None:
        """Sequencer: remove ``victims`` from the medium, persist ``touched`` recency, reserve
        room for ``job.keys`` (``skip`` those already on disk, fail with ``full`` those that do
        not fit), and set ``job.extra["shared_blocks"]`` (blocks on the medium, all processes)."""

    @abstractmethod
    def _store_block(self, job: MoverJob, index: int) -> str | None:
        """I/O thread: write key ``index`` of ``job``; ``None`` or the failure reason."""

    @abstractmethod
    def _store_after(self, job: MoverJob) -> None:
        """The job's last I/O thread: make the written blocks durable (per ``fsync``) and
        visible, release what failed; may fail keys."""

    @abstractmethod
    def _load_block(self, job: MoverJob, index: int) -> str | None:
        """I/O thread: read key ``index`` of ``job`` into its row and verify it; a corrupt block
        is dropped from the medium and logged; ``None`` or the reason (``missing``,
        ``corrupt: <why>``, an errno name)."""

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

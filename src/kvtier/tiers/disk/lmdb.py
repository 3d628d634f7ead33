"""The ``lmdb`` disk tier: an LMDB index over a preallocated slab of fixed-size block slots.

Layout of a store directory::

    kvtier-store.json   manifest (kind, layout fingerprint, capacity)
    index/              LMDB environment: the index
    slab.kvs            capacity_blocks slots of on_disk_block_bytes (4096-byte header page +
                        payload padded to 4096), preallocated with fallocate at open

Payloads live in a slab written with O_DIRECT, not in LMDB: LMDB's ``put`` of large values
reaches about half the disk's rate, the slab all of it (figures in
docs/design/disk.md#why-the-lmdb-kind-keeps-payloads-in-a-slab).

The index (four LMDB databases):

* ``blocks``: key -> (slot, recency stamp); a key is readable iff it is here;
* ``free``: slots given back (evicted, dropped); ``next_slot`` in ``meta`` is the high-water
  mark of slots never used, so a new store needs no free list of its capacity;
* ``reserved``: slot -> owner pid, for slots a store job is writing;
* ``meta``: ``next_slot``.

A store job (see :mod:`kvtier.tiers.disk.mover`): its prologue, in one write transaction, deletes
the victims' entries (freeing their slots), takes a slot per new key (free list first, then
``next_slot``; ``full`` when the slab has none — only possible when other processes fill it)
and records the reservation; the I/O threads write header + payload into the slots; the
epilogue makes them durable per ``fsync`` and, in one write transaction, publishes the entries
and drops the reservations. So an entry only ever points at a complete block, a slot is out of
the index before it is overwritten, and a crash leaves at worst reserved slots, which the next
process to open the store alone gives back. The header (key, layout, checksums) is the second
line of defence, for damage and for races with other processes.

``fsync`` (what survives an OS crash or power loss; a ``kill -9`` of the process loses nothing
committed under any policy, because commits are in the page cache, and O_DIRECT data is
already on the device):

* ``none``: no flushes; after an OS crash, recently committed blocks may be gone or fail
  verification (a miss), never served wrong;
* ``batch``: per job, one ``fdatasync`` of the slab before the index commit, and one
  flush of the index after it: a block reported stored survives an OS crash;
* ``always``: additionally one ``fdatasync`` after every block's write.

Recency: each entry carries a stamp (ns since the epoch) set when committed and refreshed for
touched keys in batches (see ``DiskTier.touch``); at open the policy is filled oldest stamp
first, so a restart keeps a sensible LRU order.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterable
from typing import cast

import lmdb

from kvtier.base import OffloadKey
from kvtier.config import format_size
from kvtier.errors import ConfigError, IndexDamagedError
from kvtier.tiers.base import CheckReport, Failure, FailureKind
from kvtier.tiers.disk.base import DiskTier
from kvtier.tiers.disk.blockio import O_DIRECT
from kvtier.tiers.disk.format import HEADER_BYTES, decode_header
from kvtier.tiers.disk.mover import MoverJob
from kvtier.tiers.disk.store import FILE_MODE, open_private, open_private_dir, own_entries, pid_alive

__all__ = ["LMDBTier"]

logger = logging.getLogger(__name__)

_INDEX_DIR = "index"
_SLAB = "slab.kvs"
_ENTRY = struct.Struct("<QQ")  # slot, recency stamp
_OWNER = struct.Struct("<Q")  # pid of the process writing a reserved slot
_NEXT_SLOT = b"next_slot"
# LMDB's map is address space, not disk: the file grows with the index. An entry costs ~60
# bytes plus B-tree slack and copy-on-write pages; 1 KiB per block leaves ample room.
_MAP_BASE_BYTES = 64 << 20
_MAP_PER_BLOCK_BYTES = 1024
_DATA_FILE = "data.mdb"
_LOCK_FILE = "lock.mdb"

# LMDB's data file as liblmdb 0.9 writes it (the version py-lmdb bundles; 64-bit builds):
# pages 0 and 1 are the two meta pages, each one page long. In each, in host byte order:
#
#   offset   0  u64  mp_pgno     0 for the first meta page, 1 for the second
#   offset  10  u16  mp_flags    P_META (0x08) set
#   offset  16  u32  mm_magic    0xBEEFC0DE
#   offset  20  u32  mm_version  1 (MDB_DATA_VERSION)
#   offset  32  u64  mm_mapsize  the map size the environment was last opened with
#   offset  40  u32  page size   (md_pad of mm_dbs[0], the free DB's record, holds it)
#   offset 136  u64  mm_last_pg  the last page in use
#   offset 144  u64  mm_txnid    the transaction that wrote this meta page
#
# LMDB reads the meta page with the larger txnid, maps the file and then touches any page up
# to mm_last_pg: a file shorter than (mm_last_pg + 1) pages is a SIGBUS waiting to happen
# (the process dies at open, or at the first read of a missing page). LMDB checks the magic
# and version itself (MDB_INVALID), but not the length, so kvtier checks it before mapping.
# lock.mdb needs no such check: the first process to open the environment (LMDB knows by an
# fcntl lock) resizes and reinitialises it, and a truncated or garbled one was found to open
# cleanly; only its type and owner are checked (_index_files_problem).
_META_PGNO = struct.Struct("=Q")
_META_FLAGS = struct.Struct("=H")
_META_HEAD = struct.Struct("=II8xQI")  # magic, version, (address), mapsize, page size
_META_TAIL = struct.Struct("=QQ")  # last page, txnid
_P_META = 0x08
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_MAX_PAGE_BYTES = 65536


def index_damage(index_dir: str) -> str | None:
    """Why the LMDB index in ``index_dir`` cannot be mapped safely, or ``None`` if it can (or
    does not exist yet: LMDB creates it). Reads the two meta pages with ``pread``; maps nothing.
    """
    if struct.calcsize("P") != 8:
        return None  # the layout above is a 64-bit build's
    path = os.path.join(index_dir, _DATA_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be opened ({exc.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return f"{path} is not a regular file"
        size = info.st_size
        if size == 0:
            return f"{path} is empty (0 bytes): LMDB writes its two meta pages when it creates it"
        head = os.pread(fd, 2 * _MAX_PAGE_BYTES, 0)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    metas = []
    page_bytes = 0
    for number in (0, 1):
        offset = number * page_bytes
        meta = head[offset : offset + 152]
        where = f"{path}: meta page {number}"
        if len(meta) < 152:
            return f"{where} is cut off (the file is {size} bytes)"
        magic, version, mapsize, psize = _META_HEAD.unpack_from(meta, 16)
        if magic != _LMDB_MAGIC:
            return f"{where} has no LMDB magic number"
        if version != _LMDB_DATA_VERSION:
            return f"{where} has data version {version}, not {_LMDB_DATA_VERSION}"
        if _META_PGNO.unpack_from(meta, 0)[0] != number or not _META_FLAGS.unpack_from(meta, 10)[0] & _P_META:
            return f"{where} is not marked as a meta page"
        if number == 0:
            if psize < 512 or psize > _MAX_PAGE_BYTES or psize & (psize - 1):
                return f"{where} gives an invalid page size ({psize})"
            page_bytes = psize
        last_page, txnid = _META_TAIL.unpack_from(meta, 136)
        metas.append((txnid, last_page, mapsize))
    _, last_page, mapsize = max(metas)
    needed = (last_page + 1) * page_bytes
    if size < needed:
        return (
            f"{path} is truncated: {size} bytes, but its meta page says pages 0..{last_page} of "
            f"{page_bytes} bytes ({needed} bytes) are in use"
        )
    if mapsize and mapsize < needed:
        return f"{path}: its meta page gives a map size ({mapsize}) smaller than its pages in use ({needed})"
    return None


# LMDB errors that mean the index file itself is damaged (not a permission or a full disk)
_DAMAGE_ERRORS = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.NotFoundError,
)


@dataclass
class _Tables:
    entries: list[tuple[OffloadKey, bytes]]
    free: set[int]
    reserved: dict[int, int]
    next_slot: int


def _lmdb_reason(exc: lmdb.Error) -> Failure:
    """The failure of an LMDB error: an index failure carrying the errno when it is a system
    error (py-lmdb carries it only in the message), else naming the error type."""
    text = str(exc)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM):
        if os.strerror(code) in text:
            return Failure(FailureKind.INDEX, code)
    return Failure(FailureKind.INDEX, detail=type(exc).__name__)


def _keyed(items: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[OffloadKey, bytes]]:
    """The blocks index's (key, entry) pairs: its keys are offload keys (for the type checker)."""
    return cast("Iterable[tuple[OffloadKey, bytes]]", items)


def _slot_key(slot: int) -> bytes:
    # big-endian, so cursor order is slot order and the free list hands out low slots first
    return slot.to_bytes(8, "big")


class LMDBTier(DiskTier):
    """A disk tier whose index is LMDB and whose blocks lie in one preallocated slab file.

    Open with :meth:`LMDBTier.open` (see :class:`~kvtier.tiers.disk.base.DiskTier`). The
    scheduler-side methods follow :class:`~kvtier.tiers.base.SecondaryTier`: they never wait
    for I/O; LMDB transactions and slab I/O run on the mover's threads.
    """

    kind = "lmdb"
    medium = "LMDB"
    max_key_bytes = 511  # LMDB's default key size limit
    medium_names = (_INDEX_DIR, _SLAB)

    # -- open / close (caller's thread) ---------------------------------------------------------

    @classmethod
    def stored_keys(cls, directory: str, limit: int) -> list[OffloadKey]:
        # the index, read-only and without a reader slot: the caller holds the store alone.
        # Only an index that is this user's, no symlink, and whole: LMDB maps data.mdb, and
        # mapping a truncated one kills the process (SIGBUS) where no except can catch it.
        index_dir = os.path.join(directory, _INDEX_DIR)
        if not own_entries(index_dir, (_DATA_FILE, _LOCK_FILE)) or index_damage(index_dir) is not None:
            return []
        with lmdb.open(index_dir, readonly=True, lock=False, create=False, max_dbs=4) as env:
            blocks = env.open_db(b"blocks", create=False)
            with env.begin(db=blocks) as txn:
                return [key for key, _ in itertools.islice(_keyed(txn.cursor()), limit)]

    def _open_medium(self, alone: bool, created: bool) -> list[tuple[OffloadKey, int, int]]:
        # typed as always there: it is, from just below until the tier closes
        self._env: lmdb.Environment = None  # type: ignore[assignment]
        self._fd = self._fd_direct = -1
        # Reservations a failed publish could not give back (the index refused every write,
        # e.g. ENOSPC): the next store prologue gives them back, so a full disk that clears
        # does not leave the slab smaller until a restart. Appended by I/O threads.
        self._unreleased: list[bytes] = []
        self._unreleased_lock = threading.Lock()
        #: why the index is damaged, when `kvtier check` found it so at open (else None)
        self._damage: str | None = None
        #: read-only (`kvtier check`): the index tables, read once at open
        self._snapshot: _Tables | None = None
        self._open_slab(alone)  # first: a capacity the disk cannot hold is the error to report
        index_dir = os.path.join(self.path, _INDEX_DIR)
        # LMDB opens its files by path: the directory and both files are checked first (never
        # a symlink; this user's; 0600, 0700)
        damage = self._index_files_problem(index_dir)
        # Checked before LMDB maps the file: a truncated data.mdb kills the process (SIGBUS).
        if damage is None:
            damage = index_damage(index_dir)
        if damage is None and self.read_only and not os.path.exists(os.path.join(index_dir, _DATA_FILE)):
            damage = f"{os.path.join(index_dir, _DATA_FILE)} is missing"
        entries: list[tuple[OffloadKey, int, int]] = []
        if damage is None:
            try:
                self._open_env(index_dir, lock=not (self.read_only and alone))
                with self._env.begin(write=not self.read_only) as txn:
                    # `kvtier check --fix` finds, reports and repairs what recovery would
                    # repair silently
                    if alone and self._access == "serve":
                        self._recover(txn)
                    entries = self._entries(txn)
                    if self.read_only:
                        self._snapshot = self._tables(txn)
            except _DAMAGE_ERRORS as exc:
                damage = f"LMDB cannot read {index_dir}: {exc}"
            except lmdb.Error as exc:
                raise ConfigError(
                    f"{self._field}.path",
                    self.config.path,
                    "a directory holding a usable LMDB index",
                    f"LMDB cannot open {index_dir} ({exc}); run `kvtier check {self.path}` or remove "
                    f"the directory to start over",
                ) from None
            if self.read_only or damage is not None:
                # read-only: everything needed is in the snapshot; no LMDB reader stays registered
                self._close_env()
        if damage is None:
            return entries
        if self._access == "serve":
            raise IndexDamagedError(
                f"tier {self.name}: index damaged: {damage}. No block is served from a damaged "
                f"index: run `kvtier check {self.path} --fix` to rebuild it from the block "
                f"headers in the slab (or remove {self.path} to start empty)"
            )
        self._damage = damage
        return []

    def _index_files_problem(self, index_dir: str) -> str | None:
        """What is wrong with index/ and its two files (a symlink, a FIFO, another user's
        file), or None; creates index/ (0700) and makes the files 0600 unless read-only."""
        try:
            index_fd = open_private_dir(_INDEX_DIR, dir_fd=self._store_fd, read_only=self.read_only)
        except FileNotFoundError:
            return f"{index_dir} is missing"
        except OSError as exc:
            raise ConfigError(
                f"{self._field}.path",
                self.config.path,
                "a store whose index directory is this user's",
                f"{index_dir}: {exc.strerror} (a symlink, or not a directory of this user's): "
                f"remove {self.path} and let kvtier recreate it",
            ) from None
        try:
            for name in (_DATA_FILE, _LOCK_FILE):
                try:
                    fd = open_private(name, os.O_RDONLY if self.read_only else os.O_RDWR, dir_fd=index_fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    return f"{os.path.join(index_dir, name)}: {exc.strerror}"
                os.close(fd)
        finally:
            os.close(index_fd)
        return None

    def _open_env(self, index_dir: str, *, lock: bool = True) -> None:
        """Open the LMDB environment (read-only for `kvtier check`) and its four databases."""
        self._env = lmdb.open(
            index_dir,
            map_size=_MAP_BASE_BYTES + self.capacity_blocks * _MAP_PER_BLOCK_BYTES,
            max_dbs=4,
            # Durability is ours to order (slab first, then the index): see _store_after.
            sync=False,
            metasync=False,
            readahead=False,  # random lookups; readahead would only evict useful pages
            max_readers=512,
            mode=FILE_MODE,  # LMDB's own default is 0644
            readonly=self.read_only,
            # Read-only and alone (the maintenance lock keeps openers out until the snapshot
            # is taken): no reader slot in lock.mdb, so `kvtier check` writes nothing at all.
            lock=lock,
            create=not self.read_only,
        )
        create = not self.read_only
        self._blocks = self._env.open_db(b"blocks", create=create)
        self._free = self._env.open_db(b"free", create=create)
        self._reserved = self._env.open_db(b"reserved", create=create)
        self._meta = self._env.open_db(b"meta", create=create)

    def _close_env(self) -> None:
        env, self._env = self._env, None  # type: ignore[assignment]  # None once closed
        if env is not None:
            with contextlib.suppress(lmdb.Error):
                env.close()

    def _tables(self, txn: lmdb.Transaction[bytes]) -> _Tables:
        """The index as check reads it: entries, free slots, reservations (slot -> pid), next slot."""
        return _Tables(
            list(_keyed(txn.cursor(db=self._blocks))),
            {int.from_bytes(k, "big") for k, _ in txn.cursor(db=self._free)},
            {int.from_bytes(k, "big"): _OWNER.unpack(v)[0] for k, v in txn.cursor(db=self._reserved)},
            self._next_slot(txn),
        )

    def _entries(self, txn: lmdb.Transaction[bytes]) -> list[tuple[OffloadKey, int, int]]:
        entries = []
        for key, value in _keyed(txn.cursor(db=self._blocks)):
            slot, stamp = _ENTRY.unpack(value)
            entries.append((key, stamp, slot))
        return entries

    def _list_blocks(self) -> list[tuple[OffloadKey, int, int]]:
        with self._env.begin() as txn:
            return self._entries(txn)

    def _give_back(self, txn: lmdb.Transaction[bytes], stale: list[bytes]) -> None:
        """End the reservations ``stale`` (slot keys) of writers that are gone: each slot goes
        back to the free list, unless indexed (a reserved slot never is, unless the index was
        damaged: never free one that is)."""
        if not stale:
            return
        indexed = {_slot_key(_ENTRY.unpack(v)[0]) for _, v in txn.cursor(db=self._blocks)}
        for slot_key in stale:
            txn.delete(slot_key, db=self._reserved)
            if slot_key not in indexed:
                txn.put(slot_key, b"", db=self._free)
        logger.info(
            "kvtier tier %s: gave back %d slots reserved by processes that died mid-write",
            self.name,
            len(stale),
        )

    def _reclaim_dead(self, txn: lmdb.Transaction[bytes]) -> int:
        """A full store's last resort before refusing: give back the slots that processes no
        longer alive had reserved (a writer killed mid-write), which only an open alone or
        ``check --fix`` would otherwise free. How many."""
        me = os.getpid()
        alive: dict[int, bool] = {}
        dead = []
        for slot_key, value in txn.cursor(db=self._reserved):
            pid = _OWNER.unpack(value)[0]
            if pid != me and not alive.setdefault(pid, pid_alive(pid)):
                dead.append(slot_key)
        self._give_back(txn, dead)
        return len(dead)

    def _recover(self, txn: lmdb.Transaction[bytes]) -> None:
        """Alone at open: give back what crashed writers reserved, and apply a smaller capacity."""
        self._give_back(txn, [key for key, _ in txn.cursor(db=self._reserved)])
        next_slot = self._next_slot(txn)
        if next_slot > self.capacity_blocks:
            cap = self.capacity_blocks
            dropped = [key for key, value in txn.cursor(db=self._blocks) if _ENTRY.unpack(value)[0] >= cap]
            for key in dropped:
                txn.delete(key, db=self._blocks)
            beyond = [key for key, _ in txn.cursor(db=self._free) if int.from_bytes(key, "big") >= cap]
            for key in beyond:
                txn.delete(key, db=self._free)
            txn.put(_NEXT_SLOT, _OWNER.pack(cap), db=self._meta)
            logger.warning(
                "kvtier tier %s: capacity lowered to %d blocks: dropped the %d blocks beyond it",
                self.name,
                cap,
                len(dropped),
            )

    def _open_slab(self, alone: bool) -> None:
        path = os.path.join(self.path, _SLAB)
        needed = self.capacity_blocks * self.slot_bytes
        field = f"{self._field}.capacity"
        if self.read_only:  # `kvtier check`: read what is there (a missing slab reads as empty)
            try:
                self._fd = open_private(_SLAB, os.O_RDONLY, dir_fd=self._store_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise ConfigError(
                    f"{self._field}.path",
                    self.config.path,
                    "a store whose slab is a file of this user's",
                    f"{path}: {exc.strerror}: remove {self.path} and let kvtier recreate it",
                ) from None
            return
        try:
            # never through a symlink, never another user's file; 0600 whatever the umask
            self._fd = open_private(_SLAB, os.O_RDWR | os.O_CREAT, dir_fd=self._store_fd)
            size = os.fstat(self._fd).st_size
            if size < needed and not self._note_room(needed - size):
                # No room for the whole slab: a sparse one, whose blocks take room as they are
                # written, and fail as ENOSPC while the disk is full (counted, never served).
                os.ftruncate(self._fd, needed)
            elif size < needed:
                try:
                    # Reserve the whole slab now: with room at open, no store fails later for
                    # want of it.
                    os.posix_fallocate(self._fd, size, needed - size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(self._fd, needed)  # no fallocate here: a sparse slab
            elif size > needed and alone:
                os.ftruncate(self._fd, needed)
            if self._io.direct:
                self._fd_direct = open_private(_SLAB, os.O_RDWR | O_DIRECT, dir_fd=self._store_fd)
        except OSError as exc:
            raise ConfigError(
                field,
                format_size(self.config.capacity_bytes),
                f"a slab of {format_size(needed)} in {self.path}",
                f"cannot prepare {path}: {exc.strerror} ({Failure.from_exception(exc)})",
            ) from None

    def _close_medium(self) -> None:
        if getattr(self, "_env", None) is not None:
            self._close_env()
        for name in ("_fd", "_fd_direct"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    # -- helpers --------------------------------------------------------------------------------

    def _next_slot(self, txn: lmdb.Transaction[bytes]) -> int:
        raw = txn.get(_NEXT_SLOT, db=self._meta)
        return _OWNER.unpack(raw)[0] if raw is not None else 0

    def _slab_fd(self, direct: bool) -> int:
        return self._fd_direct if direct else self._fd

    def _stamp(self, txn: lmdb.Transaction[bytes], keys: list[OffloadKey], stamp: int) -> None:
        for key in keys:
            value = txn.get(key, db=self._blocks)
            if value is not None:
                txn.put(key, _ENTRY.pack(_ENTRY.unpack(value)[0], stamp), db=self._blocks)

    def _index_failed(self, job: MoverJob, indexes: list[int], exc: lmdb.Error, step: str) -> None:
        reason = _lmdb_reason(exc)
        for i in indexes:
            job.reasons[i] = reason
        logger.warning(
            "kvtier tier %s: %s of job %d failed in the LMDB index (%s); its %d blocks are not "
            "served, committed blocks are untouched",
            self.name,
            step,
            job.job_id,
            exc,
            len(indexes),
        )

    # -- store (mover threads) ------------------------------------------------------------------

    def _store_before(self, job: MoverJob[list[int]], *, touched: list[OffloadKey]) -> None:
        reserved: list[int] = []
        refused = 0
        owner = _OWNER.pack(os.getpid())
        with self._unreleased_lock:
            unreleased, self._unreleased = self._unreleased, []
        try:
            with self._env.begin(write=True) as txn:
                for slot_key in unreleased:
                    if txn.delete(slot_key, db=self._reserved):
                        txn.put(slot_key, b"", db=self._free)
                for key in job.victims:
                    value = txn.get(key, db=self._blocks)
                    if value is not None:
                        txn.delete(key, db=self._blocks)
                        txn.put(_slot_key(_ENTRY.unpack(value)[0]), b"", db=self._free)
                self._stamp(txn, touched, time.time_ns())
                free = txn.cursor(db=self._free)
                next_slot = self._next_slot(txn)
                reclaimed = False
                for i, key in enumerate(job.keys):
                    value = txn.get(key, db=self._blocks)
                    if value is not None:  # committed by another process since we looked
                        job.skip[i] = True
                        job.block_ids[i] = _ENTRY.unpack(value)[0]
                        continue
                    if not reclaimed and next_slot >= self.capacity_blocks and not free.first():
                        reclaimed = True
                        if self._reclaim_dead(txn):
                            free = txn.cursor(db=self._free)
                    if free.first():
                        slot = int.from_bytes(free.key(), "big")
                        free.delete()
                    elif next_slot < self.capacity_blocks:
                        slot = next_slot
                        next_slot += 1
                    else:
                        job.reasons[i] = Failure.FULL
                        refused += 1
                        continue
                    txn.put(_slot_key(slot), owner, db=self._reserved)
                    job.block_ids[i] = slot
                    reserved.append(i)
                txn.put(_NEXT_SLOT, _OWNER.pack(next_slot), db=self._meta)
                shared = txn.stat(self._blocks)["entries"] + txn.stat(self._reserved)["entries"]
        except lmdb.Error as exc:
            with self._unreleased_lock:
                self._unreleased.extend(unreleased)  # the next prologue tries again
            job.skip = [False] * len(job.keys)
            self._index_failed(job, list(range(len(job.keys))), exc, "reserving room")
            return
        job.state = reserved  # indexes of the keys given a slot, to publish or give back
        job.shared_units = shared
        job.refused = refused

    def _store_block(self, job: MoverJob[list[int]], index: int) -> Failure | None:
        offset = job.block_ids[index] * self.slot_bytes
        key, row = job.keys[index], job.rows[index]
        try:
            self._io.with_fallback(
                "write", lambda direct: self._io.write(self._slab_fd(direct), offset, key, row, direct)
            )
            if self._fsync == "always":
                os.fdatasync(self._fd)
        except OSError as exc:
            return Failure.from_exception(exc)
        return None

    def _store_after(self, job: MoverJob[list[int]]) -> None:
        reserved: list[int] = job.state or []
        if not reserved:
            return
        written = [i for i in reserved if job.reasons[i] is None]
        if written and self._fsync == "batch":
            try:
                os.fdatasync(self._fd)  # the payloads first, so no entry outruns its block
            except OSError as exc:
                for i in written:
                    job.reasons[i] = Failure.from_exception(exc)
                written = []
        try:
            with self._env.begin(write=True) as txn:
                stamp = time.time_ns()
                for i in reserved:
                    slot_key = _slot_key(job.block_ids[i])
                    txn.delete(slot_key, db=self._reserved)
                    if job.reasons[i] is not None:
                        txn.put(slot_key, b"", db=self._free)
                        continue
                    key = job.keys[i]
                    if not txn.put(
                        key, _ENTRY.pack(job.block_ids[i], stamp), db=self._blocks, overwrite=False
                    ):
                        # another process committed this key meanwhile: keep its block
                        existing = txn.get(key, db=self._blocks)
                        assert existing is not None  # the put above found it, in this transaction
                        job.block_ids[i] = _ENTRY.unpack(existing)[0]
                        txn.put(slot_key, b"", db=self._free)
        except lmdb.Error as exc:
            self._index_failed(job, written, exc, "publishing")
            self._release(reserved, job)
            return
        if written and self._fsync != "none":
            try:
                self._env.sync(True)
            except lmdb.Error as exc:
                self._index_failed(job, written, exc, "flushing the index")

    def _release(self, reserved: list[int], job: MoverJob) -> None:
        """Best effort after a failed publish: give the job's reserved slots back."""
        try:
            with self._env.begin(write=True) as txn:
                for i in reserved:
                    slot_key = _slot_key(job.block_ids[i])
                    if txn.delete(slot_key, db=self._reserved):
                        txn.put(slot_key, b"", db=self._free)
        except lmdb.Error:
            with self._unreleased_lock:
                self._unreleased.extend(_slot_key(job.block_ids[i]) for i in reserved)
            logger.warning(
                "kvtier tier %s: could not give back %d reserved slots now; the next store job "
                "gives them back",
                self.name,
                len(reserved),
            )

    # -- load (mover threads) -------------------------------------------------------------------

    def _load_block(self, job: MoverJob, index: int) -> Failure | None:
        key, row = job.keys[index], job.rows[index]
        # Resolved now, not from the scheduler's view: another process may have moved it.
        with self._env.begin(db=self._blocks) as txn:
            value = txn.get(key)
        if value is None:
            return Failure.MISSING
        offset = _ENTRY.unpack(value)[0] * self.slot_bytes
        try:
            reason = self._io.with_fallback(
                "read", lambda direct: self._io.read(self._slab_fd(direct), offset, key, row, direct)
            )
        except OSError as exc:
            return Failure.from_exception(exc)
        if reason is None:
            return None
        return self._drop(key, value, reason)

    def _drop(self, key: OffloadKey, value: bytes, reason: Failure) -> Failure:
        """A block failed verification: out of the index (unless it moved meanwhile)."""
        slot = _ENTRY.unpack(value)[0]
        try:
            with self._env.begin(write=True) as txn:
                if txn.get(key, db=self._blocks) != value:
                    return Failure.MISSING  # evicted or rewritten by another process while we read
                txn.delete(key, db=self._blocks)
                txn.put(_slot_key(slot), b"", db=self._free)
        except lmdb.Error as exc:
            logger.warning(
                "kvtier tier %s: could not drop block %s from the index: %s", self.name, key.hex(), exc
            )
        self._log_corrupt(key, reason, f"slot {slot} of {os.path.join(self.path, _SLAB)}")
        return reason

    def _persist_stamps(self, keys: list[OffloadKey], stamp: int) -> None:
        try:
            with self._env.begin(write=True) as txn:
                self._stamp(txn, keys, stamp)
        except lmdb.Error as exc:
            # recency is a hint: losing a batch of it costs eviction quality, not data
            logger.warning(
                "kvtier tier %s: could not record recency of %d blocks: %s", self.name, len(keys), exc
            )

    # -- check (caller's thread) ----------------------------------------------------------------

    def _check_medium(self, fix: bool) -> tuple[CheckReport, list[OffloadKey]]:
        if self._damage is not None:
            return self._check_damaged(fix), []
        fix = fix and not self.read_only
        report = CheckReport(self.name)
        page, payload = self._io.check_buffers()
        fd = self._slab_fd(self._io.direct)
        cap = self.capacity_blocks
        if self._snapshot is not None:
            tables = self._snapshot
        else:
            with self._env.begin() as txn:
                tables = self._tables(txn)
        entries, free, reserved, next_slot = tables.entries, tables.free, tables.reserved, tables.next_slot
        report.blocks_checked = len(entries)
        me = os.getpid()  # jobs are drained: none of our own reservations is live
        stale = sorted(s for s, pid in reserved.items() if pid == me or not pid_alive(pid))
        live = {s: pid for s, pid in reserved.items() if s not in stale}
        bad: list[tuple[OffloadKey, bytes, int]] = []
        good: dict[int, OffloadKey] = {}
        for key, value in entries:
            slot = _ENTRY.unpack(value)[0]
            problem: str | None
            if slot >= min(cap, next_slot):
                problem = f"slot {slot} is outside the slab's used slots (0..{min(cap, next_slot) - 1})"
            elif slot in live:
                problem = f"slot {slot} is also reserved for a write by process {live[slot]}"
            elif slot in good:
                problem = f"slot {slot} is also indexed for {good[slot].hex()}"
            else:
                problem = self._io.read_for_check(fd, slot * self.slot_bytes, key, page, payload)
            if problem is None:
                good[slot] = key
            else:
                report.problems.append(f"block {key.hex()} (slot {slot}): {problem}")
                bad.append((key, value, slot))
        free_but_used = sorted(free & good.keys())
        if free_but_used:
            report.problems.append(f"{len(free_but_used)} slots holding indexed blocks are on the free list")
        free_beyond = sorted(s for s in free if s >= min(cap, next_slot))
        if free_beyond:
            report.problems.append(f"{len(free_beyond)} free-list slots are beyond the used slots")
        if stale:
            report.problems.append(f"{len(stale)} slots reserved by processes no longer writing them")
        accounted = good.keys() | free | reserved.keys() | {slot for _, _, slot in bad}
        leaked = [s for s in range(min(cap, next_slot)) if s not in accounted]
        if leaked:
            report.problems.append(f"{len(leaked)} slots are neither indexed, free nor reserved (leaked)")
        indexed = {key for key, _ in entries}
        unknown = [key for key in self._policy if key not in indexed]
        if unknown:
            report.problems.append(
                f"{len(unknown)} blocks known to this process are not in the index (removed by another process)"
            )
        slab_size = os.fstat(self._fd).st_size if self._fd >= 0 else 0
        if slab_size < cap * self.slot_bytes:
            report.problems.append(
                f"the slab is {slab_size} bytes, short of the {cap * self.slot_bytes} its capacity needs"
            )
        dropped = [key for key, _, _ in bad]
        if fix and (report.problems or unknown):
            with self._env.begin(write=True) as txn:
                freed: set[int] = set()
                for key, value, slot in bad:
                    if txn.get(key, db=self._blocks) == value:
                        txn.delete(key, db=self._blocks)
                        if slot < min(cap, next_slot) and slot not in good and slot not in live:
                            freed.add(slot)
                for slot in free_but_used + free_beyond:
                    txn.delete(_slot_key(slot), db=self._free)
                for slot in stale:
                    txn.delete(_slot_key(slot), db=self._reserved)
                    if slot not in good:  # a valid block in it stays indexed
                        freed.add(slot)
                for slot in freed:
                    txn.put(_slot_key(slot), b"", db=self._free)
                for slot in leaked:
                    txn.put(_slot_key(slot), b"", db=self._free)
            self._env.sync(True)
            if bad:
                report.fixed.append(f"dropped {len(bad)} bad blocks from the index")
            if free_but_used or free_beyond:
                report.fixed.append(
                    f"removed {len(free_but_used) + len(free_beyond)} wrong free-list entries"
                )
            if stale:
                report.fixed.append(f"gave back {len(stale)} stale reservations")
            if leaked:
                report.fixed.append(f"gave back {len(leaked)} leaked slots")
            if unknown:
                report.fixed.append(f"forgot {len(unknown)} blocks no longer in the index")
            if slab_size < cap * self.slot_bytes:
                os.posix_fallocate(self._fd, slab_size, cap * self.slot_bytes - slab_size)
                report.fixed.append("extended the slab to its capacity")
        return report, (dropped + unknown) if fix else []

    def _scan_slab(self) -> tuple[dict[OffloadKey, int], int]:
        """The intact blocks in the slab, found by their headers alone: ``({key: slot}, slots
        read)``. Every block is verified whole (header, layout, key, checksum); a key found in
        more than one slot (a freed slot keeps its old block until reused) keeps its first."""
        page, payload = self._io.check_buffers()
        fd = self._slab_fd(self._io.direct)
        found: dict[OffloadKey, int] = {}
        slots = 0
        for slot in range(self.capacity_blocks):
            offset = slot * self.slot_bytes
            try:
                if os.preadv(fd, [page], offset) < HEADER_BYTES:
                    break  # the end of the slab
            except OSError:
                continue
            slots += 1
            header = decode_header(page)
            if isinstance(header, str) or header.key in found:
                continue
            if self._io.read_for_check(fd, offset, OffloadKey(header.key), page, payload) is None:
                found[OffloadKey(header.key)] = slot
        return found, slots

    def _check_damaged(self, fix: bool) -> CheckReport:
        """Check of a store whose index was found damaged at open: report it, and with ``fix``
        rebuild the index from the blocks in the slab."""
        report = CheckReport(self.name)
        found, slots = self._scan_slab()
        report.blocks_checked = len(found)
        report.problems.append(
            f"index damaged: {self._damage}; the slab holds {len(found)} intact blocks (of {slots} "
            f"slots read), which `kvtier check {self.path} --fix` re-indexes"
        )
        if not fix or self.read_only:
            return report
        if not self._alone:
            report.problems.append(
                "the index cannot be rebuilt while other processes have the store open: stop them "
                "and run `kvtier check --fix` again"
            )
            return report
        index_dir = os.path.join(self.path, _INDEX_DIR)
        index_fd = open_private_dir(_INDEX_DIR, dir_fd=self._store_fd)
        try:
            for name in (_DATA_FILE, _LOCK_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=index_fd)  # the entry itself, even a symlink or FIFO
        finally:
            os.close(index_fd)
        self._open_env(index_dir)
        next_slot = max(found.values()) + 1 if found else 0
        used = set(found.values())
        with self._env.begin(write=True) as txn:
            for key, slot in found.items():
                txn.put(key, _ENTRY.pack(slot, 0), db=self._blocks)  # no recency known: equally old
            for slot in range(next_slot):
                if slot not in used:
                    txn.put(_slot_key(slot), b"", db=self._free)
            txn.put(_NEXT_SLOT, _OWNER.pack(next_slot), db=self._meta)
        self._env.sync(True)
        self._damage = None
        report.fixed.append(
            f"rebuilt the index from the slab's block headers: {len(found)} blocks re-indexed, "
            f"{next_slot - len(found)} slots free"
        )
        return report

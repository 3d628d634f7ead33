"""The ``files`` disk tier: one file per block, the directory tree being the index.

Layout of a store directory::

    kvtier-store.json         manifest (kind, layout fingerprint, capacity)
    blocks/00 .. blocks/ff/   256 fan-out directories (low byte of the key's xxh3-64)
        <key hex>.kvb         one block: 4096-byte header page + payload
        <key hex>.<pages>.kvb the same, where blocks vary in size (a lossless codec): the
                              pages it takes on disk, header page included
        .<key hex>.<pid>.<thread>.tmp   a block being written
    usage                     blocks (or pages) on disk, all processes: a u64 changed under flock
    recency.log               appended (stamp, key) records: the eviction order across restarts

Why one file per block (the ``lmdb`` tier uses a slab): each block is an independent file any
tool can list, copy or delete, the index needs no database, and opening scans 256 directories.
The price, a file creation per block, is hidden by the mover's threads (figures and the
rejected alternatives: docs/design/disk.md#the-files-kind-one-file-per-block). Fan-out keeps
directories at a few thousand entries, where ext4's hashed directories stay fast; names are
hex (safe on case-insensitive filesystems).

Publishing: a block is written under a temp name unique per process and thread, then renamed
to its final name with renameat2(RENAME_NOREPLACE) (Linux; else link + unlink): atomic, and it
fails if another process published the key first, which keeps the shared count exact. A crash
leaves temp files, never a torn ``.kvb``; the next process to open the store alone removes
them. A file that vanishes under a reader (another process evicted it) is a miss.

Capacity across processes: ``usage`` counts the blocks on disk. Room is reserved (count
raised) before a block is written and given back if it is not published; a file is unlinked
before the count is lowered. Every step a crash can interrupt therefore leaves the count too
high, never too low, so the directory never holds more than its capacity; the next process to
open the store alone recounts.

Where a codec's blocks vary in size (``lossless``), the count is in 4096-byte pages: a write
reserves the largest block's pages, and once the block is encoded, written and published
under a name that says its pages, gives back what it did not take; an unlink lowers the count
by the pages its name says. The same crash rule holds, the open-time recount and the
adoption of other processes' blocks read the sizes from the names (no ``stat``), and the
store holds as many blocks as their real sizes fit (docs/tiers/codecs.md).

Eviction: where blocks are all one size, an evicted block's file is renamed (by the
sequencer, in order, as an unlink would be) to a temp name of this process, written over by
one of the job's new blocks and published as a new file is: no inode or extent is allocated,
freed or trimmed, so that a full store writes as fast as one being filled, or faster
(docs/design/disk.md#a-full-store-writes-into-its-evicted-blocks-files). Its room stays
counted throughout; a failed write removes the file and gives the room back.

``fsync`` (what survives an OS crash; a ``kill -9`` loses nothing published under any
policy — a block is fully written before its name appears):

* ``none``: no flushes; after an OS crash recent blocks may be gone, or fail verification (a
  miss), never served wrong;
* ``batch``: blocks are published as written, and the job reports them stored only after a
  ``syncfs`` of the store's filesystem, begun after they were published, made their data and
  names durable together; jobs that finish while one runs share the next (see
  ``GroupFlush`` in :mod:`~kvtier.tiers.disk.group_flush`), run by the mover's finisher threads;
  while more store blocks wait for the I/O threads, a flush waits for them up to
  ``FLUSH_GATHER_S`` so that they share it too. Until then
  an OS crash may leave a just-published block that fails verification — a miss, never
  served. syncfs flushes other writers' dirty data on that filesystem too: give the store its
  own disk if it shares one with heavy buffered writers. Where there is no syncfs: each file
  is fdatasync-ed, then published, then each directory fsync-ed once, at the end of the job;
* ``always``: per block: fdatasync, publish, fsync of its directory.

Recency: ``recency.log`` gets one record per block stored and per touched block (in batches);
at open the last stamp of each key orders the policy (blocks without one count as oldest).
The log is a hint: a damaged tail is ignored, and a process alone at open rewrites it once it
holds more than twice the live records. (File mtimes were rejected: a ``stat`` of every file
doubles the cold open time.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import xxhash

from kvtier.base import OffloadKey
from kvtier.config import format_size
from kvtier.errors import ConfigError
from kvtier.tiers.base import CheckReport, Failure
from kvtier.tiers.disk.base import DiskTier
from kvtier.tiers.disk.blockio import O_DIRECT
from kvtier.tiers.disk.format import PAGE_BYTES, on_disk_block_bytes
from kvtier.tiers.disk.group_flush import GroupFlush
from kvtier.tiers.disk.mover import MoverJob
from kvtier.tiers.disk.recency import encode_records, read_recency
from kvtier.tiers.disk.store import create_private, open_private, open_private_dir, own_entries, pid_alive
from kvtier.tiers.disk.syscalls import RENAME_NOREPLACE, fallocate, renameat2, spread_subdirectories, syncfs
from kvtier.tiers.disk.usage import SharedCount

__all__ = ["FilesTier"]

logger = logging.getLogger(__name__)

_BLOCKS_DIR = "blocks"
_USAGE = "usage"
_RECENCY = "recency.log"
_SUFFIX = ".kvb"
_TEMP_SUFFIX = ".tmp"
_FANOUT = 256
#: under ``fsync: batch``, how long a flush may wait for the store blocks still queued
#: behind it, so that they share it (GroupFlush; never while the tier keeps up)
FLUSH_GATHER_S = 0.05


def _parse_name(name: str) -> tuple[OffloadKey, int] | None:
    """The key and pages of a block file's name (0 pages where the name says none); None
    for any other name."""
    if name.startswith(".") or not name.endswith(_SUFFIX):
        return None
    hexed, _, pages = name[: -len(_SUFFIX)].partition(".")
    if pages and not pages.isdigit():
        return None
    try:
        return OffloadKey(bytes.fromhex(hexed)), int(pages or 0)
    except ValueError:
        return None


@dataclass
class _FilesStoreState:
    """A store job's notes between its prologue, blocks and epilogue (key indexes)."""

    #: keys given room in the shared count (to publish, or to give back)
    reserved: list[int]
    #: keys another process published first (their room goes back)
    present: set[int] = field(default_factory=set)
    #: ``batch`` without syncfs: written temp files, flushed and published by the epilogue
    temps: dict[int, str] = field(default_factory=dict)
    #: keys written over an evicted block's file: their index -> that file's temp name
    spares: dict[int, str] = field(default_factory=dict)
    #: ``batch``: each published key's GroupFlush ticket, taken once its file was published
    tickets: dict[int, int] = field(default_factory=dict)


class FilesTier(DiskTier):
    """A disk tier storing each block as its own file (see the module docstring).

    Open with :meth:`FilesTier.open` (see :class:`~kvtier.tiers.disk.base.DiskTier`). The
    scheduler-side methods never wait for I/O; file operations run on the mover's threads.
    """

    kind = "files"
    medium = "FILES"
    # the file name is the key in hex: 2 x 100 + suffix stays under NAME_MAX (255)
    max_key_bytes = 100
    medium_names = (_BLOCKS_DIR, _USAGE, _RECENCY)
    sizes_blocks = True

    # -- open / close (caller's thread) ---------------------------------------------------------

    @classmethod
    def stored_keys(cls, directory: str, limit: int) -> list[OffloadKey]:
        # a block's file name is its key in hex; temp files start with "."
        keys: list[OffloadKey] = []
        blocks = os.path.join(directory, _BLOCKS_DIR)
        if not own_entries(blocks, ()):  # this user's, not a symlink
            return keys
        with os.scandir(blocks) as subdirs:
            for subdir in subdirs:
                if not subdir.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(subdir.path) as names:
                    for entry in names:
                        parsed = _parse_name(entry.name)
                        if parsed is not None:
                            keys.append(parsed[0])
                        if len(keys) >= limit:
                            return keys
        return keys

    def _open_medium(self, alone: bool, created: bool) -> list[tuple[OffloadKey, int, int]]:
        # typed as always there: it is, from just below until the tier closes
        self._count: SharedCount = None  # type: ignore[assignment]
        self._log_fd = self._dir_fd = self._bfd = -1
        self._spares = 0  # spare files taken (their temp names are numbered)
        self._publish_mode = "renameat2" if renameat2 is not None else "link"
        # blocks of one size: each new file allocated at that size before its write
        self._allocate_ahead = fallocate is not None and not self._sized
        self._blocks_dir = os.path.join(self.path, _BLOCKS_DIR)
        # Fan-out directories by name, relative to blocks/: every block file is reached
        # through the descriptor of blocks/ (self._bfd), never through a symlink.
        self._subdirs = [f"{i:02x}" for i in range(_FANOUT)]
        try:
            self._bfd = open_private_dir(_BLOCKS_DIR, dir_fd=self._store_fd, read_only=self.read_only)
            if not self.read_only:
                # before the fan-out directories are made: they go to block groups of their own
                spread_subdirectories(self._bfd)
                for subdir in self._subdirs:  # created, or checked and made 0700
                    os.close(open_private_dir(subdir, dir_fd=self._bfd))
        except FileNotFoundError:
            pass  # read-only check of a store without blocks/: it holds no blocks
        except OSError as exc:
            raise ConfigError(
                f"{self._field}.path",
                self.config.path,
                "a store whose block directories are this user's",
                f"{os.path.join(self._blocks_dir, str(exc.filename or ''))}: {exc.strerror} (a symlink, "
                f"or not a directory of this user's): remove {self.path} and let kvtier recreate it",
            ) from None
        self._count = SharedCount(_USAGE, dir_fd=self._store_fd, read_only=self.read_only)
        self._dir_fd = os.dup(self._store_fd)
        self._group_flush = GroupFlush(self._syncfs, busy=self._stores_waiting, gather_s=FLUSH_GATHER_S)
        # `kvtier check` (with or without --fix) reports stale temp files rather than sweep them
        blocks = self._scan(alone and self._access == "serve")
        stamps, records = read_recency(_RECENCY, self._store_fd)
        entries = [(key, stamps.get(key, 0), block_id) for key, block_id in blocks.items()]
        if self.read_only:  # `kvtier check`: nothing is written, not even the recency log
            return entries
        held = self._units([e[2] for e in entries])
        if alone:
            if held > self.capacity_units:  # the capacity was lowered
                entries.sort(key=lambda entry: entry[1])
                removed = 0
                while held > self.capacity_units:
                    key, _, block_id = entries[removed]
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path_of(key, block_id), dir_fd=self._bfd)
                    held -= self._units((block_id,))
                    removed += 1
                del entries[:removed]
                logger.warning(
                    "kvtier tier %s: capacity lowered to %s: removed the %d least recently used blocks",
                    self.name,
                    format_size(self.config.capacity_bytes),
                    removed,
                )
            self._count.set(held)
            if records > 2 * len(entries) + 4096:
                self._compact_recency(entries)
        self._note_room((self.capacity_units - held) * self.unit_bytes)
        self._log_fd = open_private(_RECENCY, os.O_WRONLY | os.O_CREAT | os.O_APPEND, dir_fd=self._store_fd)
        return entries

    def _block_of(self, name: str) -> tuple[OffloadKey, int] | None:
        """The key and block id (its pages where blocks vary in size, else 0) of a block
        file's name in this store; None for any other name."""
        parsed = _parse_name(name)
        if parsed is None:
            return None
        pages = parsed[1]
        fits = 0 < pages <= self._block_units if self._sized else pages == 0
        return parsed if fits else None

    def _scan(self, alone: bool) -> dict[OffloadKey, int]:
        """Every published block's key and block id; temp files of dead writers (all, when
        alone) removed. A key published twice at different sizes (by processes whose encoders
        differed) is listed once; its other file is removed when alone, and until then stays
        counted by the writer that reserved it."""
        blocks: dict[OffloadKey, int] = {}
        for subdir in self._subdirs:
            try:
                listing = os.scandir(os.path.join(self._blocks_dir, subdir))
            except FileNotFoundError:  # read-only check of a store missing fan-out directories
                continue
            with listing:
                for entry in listing:
                    name = entry.name
                    if name.endswith(_SUFFIX):
                        found = self._block_of(name)
                        if found is None:
                            logger.warning("kvtier tier %s: ignoring stray file %s", self.name, entry.path)
                        elif found[0] not in blocks:
                            blocks[found[0]] = found[1]
                        elif alone and not self.read_only:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(f"{subdir}/{name}", dir_fd=self._bfd)
                    elif name.endswith(_TEMP_SUFFIX) and (alone or not pid_alive(self._temp_owner(name))):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(f"{subdir}/{name}", dir_fd=self._bfd)
        return blocks

    def _list_blocks(self) -> list[tuple[OffloadKey, int, int]]:
        # no stamps (reading the recency log would cost more than the listing): equally old
        return [(key, 0, block_id) for key, block_id in self._scan(alone=False).items()]

    def _compact_recency(self, entries: list[tuple[OffloadKey, int, int]]) -> None:
        temp = f"{_RECENCY}.{os.getpid()}.tmp"
        data = b"".join(encode_records([key], stamp) for key, stamp, _ in sorted(entries, key=lambda e: e[1]))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=self._store_fd)  # left by a crash
        with open(
            open_private(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=self._store_fd), "wb"
        ) as stream:
            stream.write(data)
        os.replace(temp, _RECENCY, src_dir_fd=self._store_fd, dst_dir_fd=self._store_fd)

    def _close_medium(self) -> None:
        fd = getattr(self, "_bfd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._bfd = -1
        fd = getattr(self, "_dir_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._dir_fd = -1
        count = getattr(self, "_count", None)
        if count is not None:
            count.close()
            self._count = None  # type: ignore[assignment]
        fd = getattr(self, "_log_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._log_fd = -1

    # -- names ----------------------------------------------------------------------------------

    # Block files are named relative to blocks/ ("xx/<key hex>.kvb") and reached through its
    # descriptor; _shown() gives the full path for messages.

    def _subdir_of(self, key: OffloadKey) -> str:
        return self._subdirs[xxhash.xxh3_64_intdigest(key) & (_FANOUT - 1)]

    def _path_of(self, key: OffloadKey, block_id: int) -> str:
        """The name of ``key``'s block of id ``block_id`` (its pages where blocks vary in size)."""
        pages = f".{block_id}" if self._sized else ""
        return f"{self._subdir_of(key)}/{key.hex()}{pages}{_SUFFIX}"

    def _temp_path_of(self, key: OffloadKey, tag: object = None) -> str:
        """A temp name of ``key``'s unique to this process and ``tag`` (default: this thread);
        the owner's pid is where :meth:`_temp_owner` reads it."""
        tag = threading.get_ident() if tag is None else tag
        return f"{self._subdir_of(key)}/.{key.hex()}.{os.getpid()}.{tag}{_TEMP_SUFFIX}"

    def _shown(self, name: str) -> str:
        return os.path.join(self._blocks_dir, name)

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._bfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _fsync_subdir(self, subdir: str) -> None:
        fd = os.open(subdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._bfd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _temp_owner(name: str) -> int:
        parts = name.split(".")
        try:
            return int(parts[-3])
        except (IndexError, ValueError):
            return -1

    def _append_recency(self, keys: list[OffloadKey], stamp: int) -> None:
        if not keys or self._log_fd < 0:
            return
        try:
            os.write(self._log_fd, encode_records(keys, stamp))
        except OSError as exc:
            # recency is a hint: losing a batch of it costs eviction quality, not data
            logger.warning(
                "kvtier tier %s: could not record recency of %d blocks: %s", self.name, len(keys), exc
            )

    def _unlink_counted(self, key: OffloadKey, block_id: int) -> bool:
        """Remove a published block file and lower the shared count (file first: see the docstring)."""
        try:
            os.unlink(self._path_of(key, block_id), dir_fd=self._bfd)
        except FileNotFoundError:
            return False  # another process removed it, and counted that
        self._count.add(-self._units((block_id,)))
        return True

    # -- store (mover threads) ------------------------------------------------------------------

    def _store_before(self, job: MoverJob[_FilesStoreState], *, touched: list[OffloadKey]) -> None:
        # Each victim's file is kept for a new key of the job (renamed to a temp name, its
        # room still counted) where blocks are all one size, else removed; the rest of the
        # keys reserve room.
        spares: dict[int, str] = {}  # key index -> spare file: the first keys take them
        for key, block_id in zip(job.victims, job.victim_ids):
            try:
                if self._sized or len(spares) == len(job.keys):
                    self._unlink_counted(key, block_id)
                elif (spare := self._take_spare(key, block_id)) is not None:
                    spares[len(spares)] = spare
            except OSError as exc:
                # the block stays on disk (and counted); nothing is served wrong
                logger.warning("kvtier tier %s: could not evict %s: %s", self.name, key.hex(), exc)
        self._append_recency(touched, time.time_ns())
        # Room for every key: one another process published since this one looked is found
        # at publishing (the rename refuses to replace it) and its room goes back. A stat of
        # each block first would cost a system call a block (each hands the GIL round the
        # writer threads); only keys refused room are looked for, since those need none.
        # Each key reserves the largest block's room; _store_after gives back what it did not take.
        held = list(spares)
        todo = list(range(len(spares), len(job.keys)))
        need = self._block_units
        try:
            granted, count = self._count.reserve(len(todo) * need, self.capacity_units, need)
        except OSError as exc:  # the usage file cannot be written (EROFS, EIO): no room taken
            for i in todo:
                job.reasons[i] = Failure.from_exception(exc)
            job.state = _FilesStoreState(reserved=held, spares=spares)
            return
        granted //= need
        for i in todo[granted:]:
            # published by another process? (where blocks vary in size, its name is not known)
            if not self._sized and self._exists(self._path_of(job.keys[i], 0)):
                job.skip[i] = True
            else:
                job.reasons[i] = Failure.FULL
        job.state = _FilesStoreState(reserved=held + todo[:granted], spares=spares)
        job.shared_units = count
        job.refused = len(todo) - granted

    def _take_spare(self, key: OffloadKey, block_id: int) -> str | None:
        """Sequencer: evict ``key`` by renaming its file to a temp name of this process, to be
        written over by a new block; that name, or None if another process removed the file
        first (and counted that). Its room stays counted, as the file stays on disk."""
        self._spares += 1  # numbered: a key evicted again before its last spare is written
        spare = self._temp_path_of(key, f"s{self._spares}")
        try:
            os.rename(self._path_of(key, block_id), spare, src_dir_fd=self._bfd, dst_dir_fd=self._bfd)
        except FileNotFoundError:
            return None
        return spare

    def _store_block(self, job: MoverJob[_FilesStoreState], index: int) -> Failure | None:
        key, row = job.keys[index], job.rows[index]
        assert job.state is not None  # _store_before set it for every block it let through
        spare = job.state.spares.get(index)
        temp = spare or self._temp_path_of(key)
        try:
            stored = self._io.with_fallback(
                "write", lambda direct: self._write_file(temp, key, row, direct, spare is not None)
            )
        except BaseException as exc:
            if spare is not None:  # given up on: the file goes, and its room with the failure
                with contextlib.suppress(OSError):
                    os.unlink(spare, dir_fd=self._bfd)
            if not isinstance(exc, OSError):
                raise
            return Failure.from_exception(exc)
        if self._sized:  # its name says the pages it takes
            job.block_ids[index] = on_disk_block_bytes(stored) // PAGE_BYTES
        if self._fsync == "batch" and syncfs is None:
            job.state.temps[index] = temp  # flushed, then published, by the epilogue
            return None
        failure = self._publish_one(job, index, temp)
        if failure is None and self._fsync == "batch":
            job.state.tickets[index] = self._group_flush.ticket()
        return failure

    def _write_file(self, temp: str, key: OffloadKey, row: int, direct: bool, spare: bool) -> int:
        """Write the block into the temp file ``temp``: a new file, or a ``spare`` (an evicted
        block's, written over: the same size, so no inode or extent is allocated, and on
        filesystems mounted with ``discard`` no extent trimmed); its payload bytes. On any
        failure a new temp file is gone (a spare is kept for a buffered retry: see _store_block).

        A process still reading the evicted block through an open descriptor reads the new
        bytes, or a mix: the header then names the new key, or the checksum (or MAC) of the
        mix fails, so that read fails verification, a miss; never the wrong block served.
        """
        flags = os.O_WRONLY | (O_DIRECT if direct else 0)
        if spare:
            fd = open_private(temp, flags, dir_fd=self._bfd)
        else:
            fd = create_private(temp, flags, dir_fd=self._bfd)
        try:
            try:
                if direct and not spare and self._allocate_ahead:
                    self._allocate(fd)
                stored = self._io.write(fd, 0, key, row, direct)
                if self._fsync == "always":
                    os.fdatasync(fd)  # before publishing: a published name never points at unflushed data
            finally:
                os.close(fd)
        except BaseException:
            if not spare:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=self._bfd)
            raise
        return stored

    def _allocate(self, fd: int) -> None:
        """Give a new block's file its blocks before the O_DIRECT write, at the exact size it
        will have. Written into empty, ext4 rounds the file's request up (2 MiB and the header
        page: to 4 MiB) and gives the rest back at close; allocated ahead, the files of a
        filling store lie in runs of exactly their size (docs/design/disk.md#filling-a-store).
        A hint: where the filesystem has no fallocate it is not asked again, and a full disk
        is left for the write to report."""
        assert fallocate is not None  # _allocate_ahead is False without it
        if fallocate(fd, 0, 0, self.slot_bytes) != 0:
            if ctypes.get_errno() in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self._allocate_ahead = False

    def _publish_one(self, job: MoverJob[_FilesStoreState], index: int, temp: str) -> Failure | None:
        """Publish one written temp file from its I/O thread (``always``: durably)."""
        final = self._path_of(job.keys[index], job.block_ids[index])
        try:
            if not self._publish(temp, final):
                assert job.state is not None  # as in _store_block
                job.state.present.add(index)
                return None
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self._bfd)
            return Failure.from_exception(exc)
        if self._fsync == "always":
            try:
                self._fsync_subdir(os.path.dirname(final))
            except OSError as exc:
                self._unlink_published(final)
                return Failure.from_exception(exc)
        return None

    def _publish(self, temp: str, final: str) -> bool:
        """Make ``temp`` visible as ``final``; ``False`` if ``final`` existed (temp removed).

        Preferred: renameat2(RENAME_NOREPLACE) — one atomic step that fails if another process
        published the key first. Else link + unlink (two steps, same guarantee). Else, where
        the filesystem has neither (some FUSE and network filesystems), a plain rename, which
        may replace a copy of the same key another process just published: the shared count
        is then one too high until the next alone open recounts (never too low).
        """
        mode = self._publish_mode
        fd = self._bfd
        if mode == "renameat2":
            if renameat2(fd, temp.encode(), fd, final.encode(), RENAME_NOREPLACE) == 0:
                return True
            code = ctypes.get_errno()
            if code == errno.EEXIST:
                os.unlink(temp, dir_fd=fd)
                return False
            if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(code, os.strerror(code), self._shown(final))
            mode = self._publish_mode = "link"
        if mode == "link":
            try:
                os.link(temp, final, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                os.unlink(temp, dir_fd=fd)
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                self._publish_mode = "rename"
            else:
                os.unlink(temp, dir_fd=fd)
                return True
        os.rename(temp, final, src_dir_fd=fd, dst_dir_fd=fd)
        return True

    def _unlink_published(self, final: str) -> None:
        """Withdraw a block just published (its reservation goes back with its failure)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(final, dir_fd=self._bfd)

    def _store_after(self, job: MoverJob[_FilesStoreState]) -> None:
        state = job.state
        if state is None:
            return
        reserved = state.reserved
        present = state.present
        temps = state.temps
        if temps:
            self._publish_batch(job, temps)
        elif self._fsync == "batch":
            # One syncfs makes the job's data, inodes and new names durable together, far
            # cheaper than an fdatasync per file and per directory; jobs finishing while one
            # runs share the next (docs/design/disk.md#one-syncfs-per-job).
            published = [i for i in reserved if job.reasons[i] is None and i not in present]
            if published:
                try:
                    # one shared syncfs begun after the last of them was published
                    tickets = state.tickets
                    covered = all(i in tickets for i in published)
                    self._group_flush.flush(max(tickets[i] for i in published) if covered else None)
                except OSError as exc:
                    self._withdraw(job, published, Failure.from_exception(exc))
        # reservations of blocks that were not published by us go back, and of those that
        # were, what they did not take
        need = self._block_units
        unused = sum(
            need if job.reasons[i] is not None or i in present else need - self._units((job.block_ids[i],))
            for i in reserved
        )
        if unused:
            try:
                self._count.add(-unused)
            except OSError as exc:
                # the count stays too high, the safe way (see the module docstring), until
                # the next process alone at open recounts; the published blocks stand
                logger.warning(
                    "kvtier tier %s: could not give back %d reserved units in %s: %s",
                    self.name,
                    unused,
                    self.path,
                    exc,
                )
        stored = [job.keys[i] for i in reserved if job.reasons[i] is None and i not in present]
        self._append_recency(stored, time.time_ns())

    def _stores_waiting(self) -> bool:
        mover = self._mover
        return mover is not None and mover.stores_waiting()

    def _syncfs(self) -> None:
        """syncfs(2) of the store's filesystem; raises OSError."""
        self._counters.add("flushes")
        if syncfs(self._dir_fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def _publish_batch(self, job: MoverJob[_FilesStoreState], temps: dict[int, str]) -> None:
        """``batch`` without syncfs: flush each file, publish them all, flush each directory once."""
        state = job.state
        assert state is not None  # called by _store_after with it
        for index, temp in temps.items():
            try:
                fd = open_private(temp, os.O_RDONLY, dir_fd=self._bfd)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                job.reasons[index] = Failure.from_exception(exc)
        directories: dict[str, list[int]] = {}
        for index, temp in temps.items():
            if job.reasons[index] is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=self._bfd)
                continue
            final = self._path_of(job.keys[index], job.block_ids[index])
            try:
                if not self._publish(temp, final):
                    state.present.add(index)
                    continue
            except OSError as exc:
                job.reasons[index] = Failure.from_exception(exc)
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=self._bfd)
                continue
            directories.setdefault(os.path.dirname(final), []).append(index)
        for directory, indexes in directories.items():
            try:
                self._fsync_subdir(directory)
            except OSError as exc:
                self._withdraw(job, indexes, Failure.from_exception(exc))

    def _withdraw(self, job: MoverJob, indexes: list[int], reason: Failure) -> None:
        """Blocks published but not made durable: unpublish and fail them rather than report
        blocks that might not survive an OS crash."""
        for index in indexes:
            self._unlink_published(self._path_of(job.keys[index], job.block_ids[index]))
            job.reasons[index] = reason

    # -- load (mover threads) -------------------------------------------------------------------

    def _load_block(self, job: MoverJob, index: int) -> Failure | None:
        key, row, block_id = job.keys[index], job.rows[index], job.block_ids[index]
        path = self._path_of(key, block_id)
        try:
            reason, identity = self._io.with_fallback(
                "read", lambda direct: self._read_file(path, key, row, direct)
            )
        except FileNotFoundError:
            return Failure.MISSING  # evicted by another process, or never there
        except OSError as exc:
            return Failure.from_exception(exc)
        if reason is None:
            return None
        assert identity is not None  # _read_file gives one with every reason
        return self._drop(key, block_id, identity, reason)

    def _read_file(
        self, path: str, key: OffloadKey, row: int, direct: bool
    ) -> tuple[Failure | None, os.stat_result | None]:
        # O_NONBLOCK and a regular-file check (open_private): a FIFO under a block's name
        # is a failed read, never a load that waits for ever
        fd = open_private(path, os.O_RDONLY | (O_DIRECT if direct else 0), dir_fd=self._bfd)
        try:
            reason = self._io.read(fd, 0, key, row, direct)
            return reason, (os.fstat(fd) if reason is not None else None)
        finally:
            os.close(fd)

    def _drop(self, key: OffloadKey, block_id: int, identity: os.stat_result, reason: Failure) -> Failure:
        """A block failed verification: remove its file, unless another replaced it meanwhile."""
        path = self._path_of(key, block_id)
        try:
            now = os.stat(path, dir_fd=self._bfd, follow_symlinks=False)
        except FileNotFoundError:
            return Failure.MISSING
        # replaced under us, or written over and renamed since (an evicted block's file is
        # reused: the same inode may come back under this name, its ctime newer): unread
        seen = (identity.st_dev, identity.st_ino, identity.st_ctime_ns)
        if (now.st_dev, now.st_ino, now.st_ctime_ns) != seen:
            return Failure.MISSING
        try:
            self._unlink_counted(key, block_id)
        except OSError as exc:
            logger.warning(
                "kvtier tier %s: could not remove damaged %s: %s", self.name, self._shown(path), exc
            )
        self._log_corrupt(key, reason, self._shown(path))
        return reason

    def _persist_stamps(self, keys: list[OffloadKey], stamp: int) -> None:
        self._append_recency(keys, stamp)

    # -- check (caller's thread) ----------------------------------------------------------------

    def _check_medium(self, fix: bool) -> tuple[CheckReport, list[OffloadKey]]:
        report = CheckReport(self.name)
        page, payload = self._io.check_buffers()
        direct = self._io.direct
        bad_files: list[tuple[str, int]] = []  # and the units each is counted at
        bad_keys: list[OffloadKey] = []
        stray: list[str] = []
        found: set[OffloadKey] = set()
        found_units = bad_units = 0
        me = os.getpid()
        fix = fix and not self.read_only
        for subdir in self._subdirs:
            try:
                with os.scandir(os.path.join(self._blocks_dir, subdir)) as listing:
                    names = [(entry.name, f"{subdir}/{entry.name}") for entry in listing]
            except FileNotFoundError:
                report.problems.append(f"{self._shown(subdir)}: fan-out directory missing")
                continue
            for name, path in names:
                shown = self._shown(path)
                if name.endswith(_TEMP_SUFFIX):
                    owner = self._temp_owner(name)
                    if owner == me or not pid_alive(owner):  # jobs are drained: ours are stale too
                        report.problems.append(f"{shown}: temp file of a writer that is gone")
                        stray.append(path)
                    continue
                parsed = self._block_of(name)
                if parsed is None:
                    report.problems.append(f"{shown}: not a block file")
                    stray.append(path)
                    continue
                key, block_id = parsed
                units = self._units((block_id,))
                report.blocks_checked += 1
                problem: str | None
                if self._subdir_of(key) != subdir:
                    problem = "in the wrong fan-out directory"
                else:
                    try:
                        # a FIFO or symlink under a block's name: a problem, never a hang
                        fd = open_private(path, os.O_RDONLY | (O_DIRECT if direct else 0), dir_fd=self._bfd)
                    except FileNotFoundError:
                        continue  # removed by another process meanwhile
                    except OSError as exc:
                        problem = f"{exc.strerror} ({Failure.from_exception(exc)})"
                    else:
                        try:
                            problem = self._io.read_for_check(fd, 0, key, page, payload)
                            # the room it is counted at bounds the bytes it takes
                            size = os.fstat(fd).st_size
                            if problem is None and size > units * self.unit_bytes:
                                problem = (
                                    f"{size} bytes, more than the {units * self.unit_bytes} it is counted at"
                                )
                        finally:
                            os.close(fd)
                if problem is None:
                    found.add(key)
                    found_units += units
                else:
                    report.problems.append(f"{shown}: {problem}")
                    bad_files.append((path, units))
                    bad_keys.append(key)
                    bad_units += units
        what = "pages" if self._sized else "blocks"
        on_disk = found_units + bad_units
        if on_disk > self.capacity_units:
            report.problems.append(
                f"{on_disk} {what} on disk, more than the capacity of {self.capacity_units}"
            )
        counted = self._count.get()
        if counted < on_disk:
            report.problems.append(f"the usage count says {counted} {what}, but {on_disk} are on disk")
        unknown = [key for key in self._policy if key not in found and key not in bad_keys]
        if unknown:
            report.problems.append(
                f"{len(unknown)} blocks known to this process are not on disk (removed by another process)"
            )
        if fix:
            removed = removed_units = 0
            for path, units in bad_files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path, dir_fd=self._bfd)
                    removed += 1
                    removed_units += units
            for path in stray:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path, dir_fd=self._bfd)
            if removed:
                self._count.add(-removed_units)
                report.fixed.append(f"removed {removed} bad block files")
            if stray:
                report.fixed.append(f"removed {len(stray)} stray or stale temp files")
            if counted < on_disk:
                self._count.set(found_units)
                report.fixed.append(f"set the usage count to {found_units}")
            if unknown:
                report.fixed.append(f"forgot {len(unknown)} blocks no longer on disk")
        return report, (bad_keys + unknown) if fix else []

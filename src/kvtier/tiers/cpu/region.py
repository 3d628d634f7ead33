"""One shared-memory region of fixed-size rows: the bytes of the CPU tier.

The region is a file (by default under ``/dev/shm``, so it lives in RAM) mapped with
``MAP_SHARED``. One process creates it; others (GPU workers, a disk mover) attach to it by
name and see the same bytes with no copy between processes. Layout of the file::

    offset 0      one 4096-byte header page: magic, format version, geometry, and the
                  creator's pid, start time, uid and pid namespace (for the stale sweep)
    offset 4096   row 0, row 1, ... each ``row_stride`` bytes apart (row_bytes rounded up
                  to 4096), the first ``row_bytes`` of each row used

Who calls what: the scheduler-side tier (:class:`kvtier.tiers.cpu.backend.CPUBackend`) creates the
region; workers and movers :meth:`SharedRegion.attach` to it. None of the methods take locks:
which process writes which row when is decided by the manager's slot bookkeeping.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import secrets
import stat
import re
import struct
import tempfile
import weakref
from collections.abc import Iterator

import numpy as np

from kvtier import cuda as _cuda
from kvtier.config.units import format_size, positive_int
from kvtier.errors import ConfigError, KvtierError

#: ``pin_memory`` modes (:meth:`SharedRegion.pin`): auto (pin when CUDA is present), on (fail
#: if it cannot), off
PIN_MEMORY_CHOICES = ("auto", "on", "off")

__all__ = [
    "HEADER_BYTES",
    "NAME_PREFIX",
    "ROW_ALIGNMENT",
    "SharedRegion",
    "default_directory",
    "find_region",
    "process_start_ticks",
    "row_stride_for",
    "sweep_stale_regions",
    "unique_region_path",
]

logger = logging.getLogger(__name__)

#: rows start on, and are a multiple of, this many bytes
ROW_ALIGNMENT = 4096
#: bytes of the header page in front of the rows
HEADER_BYTES = 4096

_MAGIC = b"KVTIERSH"
_FORMAT_VERSION = 1
# magic, format version, header bytes, num_rows, row_bytes, row_stride, creator pid
_HEADER = struct.Struct("<8sIIQQQQ")
# right after it (zeros in a region of an older kvtier: unknown): the creator's start time
# (clock ticks since boot, /proc/<pid>/stat), which tells a live creator from a process that
# reused its pid; the creator's uid; the inode of its pid namespace (a creator in another
# container sharing /dev/shm has pids this process cannot see: never swept from here)
_CREATOR = struct.Struct("<QQQ")
#: what every region's file name starts with; a start sweeps such files left by dead creators
NAME_PREFIX = "kvtier-"


def process_start_ticks(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot; 0 if unknown (no /proc, or no
    such process). Two processes that share a pid at different times differ here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of the whole line: starttime
    except (OSError, IndexError, ValueError):
        return 0


def _pid_namespace() -> int:
    """The inode of this process's pid namespace; 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _creator_alive(pid: int, start_ticks: int) -> bool:
    """Whether the process that created a region (``pid``, started at ``start_ticks``, 0 if
    the region does not say) still runs. A pid now used by a process that started at another
    time is a dead creator; without a start time a live pid counts as alive (the safe side)."""
    if pid <= 0:
        return True  # not a header this kvtier wrote: never swept
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, as another user: a reused pid if its start time differs
    if start_ticks:
        now = process_start_ticks(pid)
        return now == 0 or now == start_ticks
    return True


def _own_regions(directory: str, names: list[str]) -> Iterator[tuple[str, os.stat_result, int, bool]]:
    """Of ``names`` in ``directory``, the regions of this user's with a complete header, as
    ``(path, stat, creator pid, creator judged dead)``: never through a symlink, never another
    user's file or one still being created. Best effort: what cannot be read is passed over."""
    uid, own_namespace = os.geteuid(), _pid_namespace()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # a symlink (ELOOP), gone, or not ours to read
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                continue
            raw = os.pread(fd, _HEADER.size + _CREATOR.size, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(raw) < _HEADER.size + _CREATOR.size or raw[: len(_MAGIC)] != _MAGIC:
            continue
        pid = _HEADER.unpack_from(raw)[6]
        start_ticks, _, namespace = _CREATOR.unpack_from(raw, _HEADER.size)
        # a pid of another namespace cannot be judged here: never dead
        dead = bool(own_namespace) and namespace == own_namespace and not _creator_alive(pid, start_ticks)
        yield path, info, pid, dead


def sweep_stale_regions(directory: str | None = None) -> list[str]:
    """Remove the regions in ``directory`` (default :func:`default_directory`) whose creator
    is dead: files named ``kvtier-*``, regular, owned by this user, with a kvtier region
    header naming a process that no longer runs (or a pid reused since, told apart by its
    start time). Never follows a symlink, never touches another user's file or a file
    without a complete header (a region still being created). The removed paths.

    Called by :meth:`SharedRegion.create` (so a start cleans up after a run that was killed
    with SIGKILL, or crashed); best effort: a file it cannot read is left, and it never raises.
    """
    directory = directory or default_directory()
    removed: list[str] = []
    try:
        names = [name for name in os.listdir(directory) if name.startswith(NAME_PREFIX)]
    except OSError:
        return removed
    for path, info, pid, dead in _own_regions(directory, names):
        if not dead:
            continue
        try:
            # the same file we read (not one swapped in since): same inode, still ours
            now = os.lstat(path)
            if (now.st_ino, now.st_dev, now.st_uid) != (info.st_ino, info.st_dev, info.st_uid):
                continue
            os.unlink(path)
        except OSError:
            continue
        logger.warning(
            "removed %s: a kvtier shared region (%s) whose creator, pid %d, is gone",
            path,
            format_size(info.st_size),
            pid,
        )
        removed.append(path)
    return removed


#: the random part of a region named after a stem (:func:`unique_region_path`)
_SUFFIX_HEX = 16


def unique_region_path(stem: str) -> str:
    """A new region path made of ``stem`` (a path both sides of an engine derive, such as
    ``/dev/shm/kvtier-<engine id>``) and a random suffix: where the creator puts the region,
    so that no other user can take the name first (they could the stem itself); the other
    side finds it with :func:`find_region`."""
    return f"{stem}-{secrets.token_hex(_SUFFIX_HEX // 2)}"


def find_region(stem: str) -> str | None:
    """The path of the region :func:`unique_region_path` made for ``stem``: a regular file of
    this user's, not a symlink, with a complete header and a live creator (the newest, should
    there be several); None while there is none. Files other users put there are passed over."""
    directory, prefix = os.path.split(stem)
    pattern = re.compile(re.escape(prefix) + f"-[0-9a-f]{{{_SUFFIX_HEX}}}")
    try:
        names = [name for name in os.listdir(directory or ".") if pattern.fullmatch(name)]
    except OSError:
        return None
    live = [
        (info.st_mtime_ns, path) for path, info, _, dead in _own_regions(directory or ".", names) if not dead
    ]
    return max(live)[1] if live else None


def row_stride_for(row_bytes: int) -> int:
    """Bytes between the starts of two rows holding ``row_bytes`` each.

    Rounded up to 4096 so that every row starts on a page boundary: a row can then be the
    buffer of an ``O_DIRECT`` read or write (which needs block-aligned addresses and lengths),
    and a DMA engine copying a row never straddles a partial page shared with its neighbour.
    The cost is at most one page of padding per row, small against KV blocks of hundreds of KiB.
    """
    return -(-row_bytes // ROW_ALIGNMENT) * ROW_ALIGNMENT


def default_directory() -> str:
    """Where regions are created when no path is given: ``/dev/shm``, else the temp directory.

    ``/dev/shm`` is a RAM-backed tmpfs on Linux; elsewhere (macOS) the temp directory is the
    closest thing, and the page cache keeps the file's pages in memory while it is mapped.
    """
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _reserve(fd: int, path: str, file_bytes: int, field: str) -> None:
    """Allocate every page of the region's file now, or raise :class:`ConfigError`.

    On tmpfs (``/dev/shm``) ``ftruncate`` only sets a size: pages are allocated on first
    write, and a first write that finds the filesystem full is a SIGBUS that kills the
    process — at any later time, if something else fills ``/dev/shm`` meanwhile. A
    ``posix_fallocate`` of the whole file moves that failure to start-up, as an error. The
    price, linear in the size, is paid at once instead of on each row's first use (figures
    and the rejected ``MAP_POPULATE``: docs/design/cpu-region.md).
    """
    if not hasattr(os, "posix_fallocate"):  # macOS: no tmpfs /dev/shm, and no SIGBUS to avoid
        return
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a filesystem that cannot reserve (rare for shared memory): as before
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        directory = os.path.dirname(path) or "."
        try:
            stats = os.statvfs(directory)
            free_bytes = stats.f_bavail * stats.f_frsize
            free = f"{format_size(free_bytes)} ({free_bytes} bytes)"
        except OSError:
            free = "an unknown amount"
        raise ConfigError(
            field,
            format_size(file_bytes),
            f"room for the shared region ({file_bytes} bytes) in {directory}: {free} free there now",
            f"lower the CPU tier's capacity, free space in {directory} (remove stale "
            f"kvtier-* files), or give it more room (for /dev/shm: mount -o remount,size=<larger> "
            f"/dev/shm; in Docker: --shm-size)",
        ) from None


#: the most one cudaHostRegister call is given: on r580 drivers a single registration of
#: 512 GiB or more fails whatever memory is free (seen by vLLM and LMCache), so a large
#: region is registered in pieces
PIN_CHUNK_BYTES = 64 << 30


def pin_chunks(address: int, nbytes: int, limit: int) -> list[tuple[int, int]]:
    """``(start, size)`` pieces covering ``[address, address + nbytes)`` in order, each at
    most ``limit`` bytes, cut only at page boundaries (a page registered twice would fail)."""
    page = mmap.PAGESIZE
    step = max(page, limit // page * page)
    end = address + nbytes
    cuts = [address]
    while end - cuts[-1] > limit:
        cuts.append((cuts[-1] + step) // page * page)
    return [(start, stop - start) for start, stop in zip(cuts, [*cuts[1:], end])]


class _Mapping:
    """What must be released for one region; held by the finalizer, so never by ``self``."""

    __slots__ = ("mm", "rows", "path", "owner_pid", "pinned_ptrs", "pinned_pid")

    def __init__(self, mm: mmap.mmap, rows: np.ndarray, path: str, owner_pid: int | None):
        self.mm: mmap.mmap | None = mm
        self.rows: np.ndarray | None = rows
        self.path = path
        # pid of the process that must unlink the file (the creator), None for an attacher
        self.owner_pid = owner_pid
        # the start of each range registered with cudaHostRegister (none when not pinned),
        # and by which process: a registration belongs to one process's CUDA context and is
        # not inherited by fork
        self.pinned_ptrs: tuple[int, ...] = ()
        self.pinned_pid = 0

    def pinned_here(self) -> bool:
        return bool(self.pinned_ptrs) and self.pinned_pid == os.getpid()


def _release(state: _Mapping) -> None:
    # Runs from close(), from garbage collection or at interpreter exit: it must never raise.
    if state.pinned_ptrs:
        pinned_here = state.pinned_here()
        ptrs, state.pinned_ptrs = state.pinned_ptrs, ()
        # A forked child inherits the mapping but not the registration (nor a usable CUDA
        # context): only the process that pinned may unpin.
        for ptr in ptrs if pinned_here else ():
            try:
                _cuda.host_unregister(ptr)
            except Exception:
                logger.warning("unpinning %s failed", state.path, exc_info=True)
    state.rows = None
    mm, state.mm = state.mm, None
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            # numpy views of the rows are still alive. Dropping our reference is enough: the
            # views keep the mmap object alive and it unmaps itself when the last one dies.
            # Forcing an unmap instead would turn every such view into a segfault.
            logger.debug("views of %s are alive; it is unmapped when they die", state.path)
        except Exception:
            logger.warning("unmapping %s failed", state.path, exc_info=True)
    # Only the creator unlinks, and only in its own process: a forked child that exits (say a
    # multiprocessing worker) must not pull the file from under its parent.
    if state.owner_pid is not None and state.owner_pid == os.getpid():
        try:
            os.unlink(state.path)
        except FileNotFoundError:
            pass
        except Exception:
            logger.warning("removing %s failed", state.path, exc_info=True)


class SharedRegion:
    """``num_rows`` rows of ``row_bytes`` each in one shared, mapped file.

    Build it with :meth:`create` (the owner, which removes the file on :meth:`close`) or
    :meth:`attach` (another process, which never removes it). Release is deterministic with
    :meth:`close`, and also happens when the object is garbage-collected or the interpreter
    exits. Once every process has closed or exited and the creator has unlinked the file,
    the memory goes back to the system.
    """

    def __init__(
        self,
        mm: mmap.mmap,
        path: str,
        num_rows: int,
        row_bytes: int,
        row_stride: int,
        creator: bool,
    ):
        """Use :meth:`create` or :meth:`attach`; this wraps a mapping they have validated."""
        self._path = path
        self._num_rows = num_rows
        self._row_bytes = row_bytes
        self._row_stride = row_stride
        self._creator = creator
        # One view made once: every later view (row(i), slices) derives from it, so there is
        # no per-call array construction. frombuffer, not ndarray(buffer=mm): only frombuffer
        # keeps a buffer export on the mmap, which is what makes mm.close() refuse (rather
        # than unmap under a live view and turn the next access into a segfault).
        flat = np.frombuffer(mm, dtype=np.uint8, count=num_rows * row_stride, offset=HEADER_BYTES)
        rows = flat.reshape(num_rows, row_stride)[:, :row_bytes]
        # ctypes gives the mapping's address without numpy's help; the temporary export it
        # takes is dropped at once so it cannot block a later mm.close().
        anchor = ctypes.c_char.from_buffer(mm)
        self._address = ctypes.addressof(anchor) + HEADER_BYTES
        del anchor
        self._state = _Mapping(mm, rows, path, os.getpid() if creator else None)
        self._finalizer = weakref.finalize(self, _release, self._state)

    # -----------------------------------------------------------------------------------------
    # construction

    @classmethod
    def create(
        cls,
        num_rows: int,
        row_bytes: int,
        *,
        path: str | None = None,
        field: str = "capacity",
        sweep: bool = True,
    ) -> SharedRegion:
        """Create a fresh region, zero-filled, and map it.

        Called once, by the tier's owner (the scheduler side), at start-up. Blocks while the
        file's pages are reserved (:func:`_reserve`; under a second per GiB on tmpfs).
        ``path`` defaults to ``/dev/shm/kvtier-<pid>-<random hex>``; an explicit path must
        not exist yet (a stale file of a crashed run is never reused silently). A filesystem
        without room for the whole region raises :class:`ConfigError` naming ``field``, the
        size, the free room and the fix. The file is 0600 whatever the umask, and its header
        records the creator's pid, start time and uid. ``sweep``: first remove this user's
        regions in the same directory whose creator is dead (:func:`sweep_stale_regions`).
        """
        num_rows = positive_int(num_rows, "num_rows")
        row_bytes = positive_int(row_bytes, "row_bytes")
        row_stride = row_stride_for(row_bytes)
        file_bytes = HEADER_BYTES + num_rows * row_stride
        if path is None:
            path = os.path.join(default_directory(), f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        if sweep:
            sweep_stale_regions(os.path.dirname(path) or ".")
        try:
            # O_EXCL: never adopt (and later unlink) a file somebody else owns, nor follow a
            # symlink planted at the path (O_NOFOLLOW says so explicitly); 0o600 because the
            # region holds users' KV data.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise KvtierError(
                f"cannot create shared region {path}: the file already exists (left by a "
                f"crashed run, or used by another process); remove it or choose another path"
            ) from None
        except OSError as exc:
            raise KvtierError(f"cannot create shared region {path}: {exc.strerror}") from exc
        mm = None
        try:
            # The umask may have taken bits off 0o600 (a 0o400 region could not be attached
            # for writing by the user's own workers); never more than 0o600 either way.
            os.fchmod(fd, 0o600)
            # Size first, header last: the file reads as all zeros (bad magic) until the
            # header is complete, so an attacher racing the creator fails cleanly instead of
            # reading a half-written geometry.
            os.ftruncate(fd, file_bytes)
            _reserve(fd, path, file_bytes, field)
            mm = mmap.mmap(fd, file_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            header = _HEADER.pack(
                _MAGIC,
                _FORMAT_VERSION,
                HEADER_BYTES,
                num_rows,
                row_bytes,
                row_stride,
                os.getpid(),
            ) + _CREATOR.pack(process_start_ticks(os.getpid()), os.geteuid(), _pid_namespace())
            mm[len(_MAGIC) : len(header)] = header[len(_MAGIC) :]
            mm[: len(_MAGIC)] = _MAGIC
            return cls(mm, path, num_rows, row_bytes, row_stride, creator=True)
        except BaseException as exc:
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
            os.unlink(path)
            if isinstance(exc, OSError):
                raise KvtierError(
                    f"cannot size or map shared region {path} ({file_bytes} bytes): {exc.strerror}"
                ) from exc
            raise
        finally:
            # mmap keeps its own duplicate of the descriptor; ours is never needed after.
            os.close(fd)

    @classmethod
    def attach(cls, path_or_name: str, *, owner_uid: int | None = None) -> SharedRegion:
        """Map a region another process created, by path or by bare name (in ``/dev/shm``).

        Called by workers and movers at start-up, after the creator returned from
        :meth:`create` (the name travels to them through configuration or IPC). Blocks only
        to open and map the file. Raises :class:`KvtierError`, naming the path, if the file is
        missing or is not a complete kvtier region. The attacher never removes the file.

        ``owner_uid`` is the creator's user (default: this process's, as every process of
        one engine runs as one user). The file must be a regular file owned by it, not
        writable by group or others, reached without a symlink: another local user cannot
        plant a region (names are predictable under vLLM: ``kvtier-<engine id>``) that the
        engine would then fill with its users' KV data, nor point it at a file of theirs.
        """
        path = path_or_name
        if os.sep not in path_or_name:
            path = os.path.join(default_directory(), path_or_name)
        expected_uid = os.geteuid() if owner_uid is None else owner_uid
        try:
            # O_NOFOLLOW: a symlink at the path fails (ELOOP) instead of being followed;
            # O_NONBLOCK: a FIFO planted there cannot hang the open.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KvtierError(
                    f"cannot attach shared region {path}: it is a symlink; a region is never "
                    f"reached through one (remove it, and check who put it there)"
                ) from exc
            raise KvtierError(f"cannot attach shared region {path}: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise KvtierError(f"cannot attach shared region {path}: not a regular file")
            if info.st_uid != expected_uid:
                raise KvtierError(
                    f"cannot attach shared region {path}: it is owned by uid {info.st_uid}, "
                    f"not by its creator's user (uid {expected_uid}); refusing a region another "
                    f"user may have planted (remove it, and check who put it there)"
                )
            if info.st_mode & 0o022:
                raise KvtierError(
                    f"cannot attach shared region {path}: its mode is "
                    f"{stat.S_IMODE(info.st_mode):#o}, writable by other users; kvtier regions "
                    f"are 0600 (chmod 600 it if it is yours, or remove it)"
                )
            file_bytes = info.st_size
            if file_bytes < HEADER_BYTES:
                raise KvtierError(
                    f"{path} is not a kvtier shared region: {file_bytes} bytes is too small "
                    f"for its {HEADER_BYTES}-byte header (truncated, or still being created)"
                )
            raw = os.pread(fd, _HEADER.size, 0)
            magic, version, header_bytes, num_rows, row_bytes, row_stride, creator_pid = _HEADER.unpack(raw)
            if magic != _MAGIC:
                raise KvtierError(
                    f"{path} is not a kvtier shared region: bad magic {magic!r} "
                    f"(expected {_MAGIC!r}; or its creator has not finished writing it)"
                )
            if version != _FORMAT_VERSION:
                raise KvtierError(
                    f"{path} has shared-region format version {version}; this kvtier reads "
                    f"version {_FORMAT_VERSION}: run the same kvtier version in every process"
                )
            if (
                header_bytes != HEADER_BYTES
                or num_rows < 1
                or row_bytes < 1
                or row_stride != row_stride_for(row_bytes)
            ):
                raise KvtierError(
                    f"{path} has a corrupt shared-region header: header_bytes={header_bytes}, "
                    f"num_rows={num_rows}, row_bytes={row_bytes}, row_stride={row_stride}"
                )
            expected = HEADER_BYTES + num_rows * row_stride
            if file_bytes < expected:
                raise KvtierError(
                    f"{path} is truncated: {file_bytes} bytes, but its header "
                    f"({num_rows} rows of stride {row_stride}) needs {expected}"
                )
            mm = mmap.mmap(fd, expected, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        logger.debug("attached %s (created by pid %d)", path, creator_pid)
        return cls(mm, path, num_rows, row_bytes, row_stride, creator=False)

    # -----------------------------------------------------------------------------------------
    # geometry

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    @property
    def name(self) -> str:
        """The file's base name: what :meth:`attach` takes for a region in ``/dev/shm``."""
        return os.path.basename(self._path)

    @property
    def num_rows(self) -> int:
        """How many rows the region has."""
        return self._num_rows

    @property
    def row_bytes(self) -> int:
        """Usable bytes per row."""
        return self._row_bytes

    @property
    def row_stride(self) -> int:
        """Bytes from one row's start to the next (``row_bytes`` rounded up to 4096)."""
        return self._row_stride

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the rows, padding included (the range :meth:`pin` registers)."""
        return self._num_rows * self._row_stride

    @property
    def is_creator(self) -> bool:
        """Whether this object created the file (and so removes it on :meth:`close`)."""
        return self._creator

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (explicitly or by finalisation)."""
        return not self._finalizer.alive

    # -----------------------------------------------------------------------------------------
    # access

    def _live_rows(self) -> np.ndarray:
        rows = self._state.rows
        if rows is None:
            raise KvtierError(f"shared region {self._path} is closed")
        return rows

    @property
    def rows(self) -> np.ndarray:
        """All rows as a zero-copy ``uint8`` view of shape ``(num_rows, row_bytes)``.

        Strided over ``row_stride``; contiguous when ``row_bytes`` is a multiple of 4096.
        Any thread or process holding the region may use it; it never blocks.
        """
        return self._live_rows()

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` as a zero-copy ``uint8`` view of ``row_bytes`` bytes."""
        if not 0 <= index < self._num_rows:
            raise IndexError(f"row {index} out of range for {self._num_rows} rows")
        return self._live_rows()[index]

    @property
    def address(self) -> int:
        """Virtual address of row 0 in this process (page-aligned), for ``cudaHostRegister``."""
        self._live_rows()
        return self._address

    # -----------------------------------------------------------------------------------------
    # pinning and release

    @property
    def pinned(self) -> bool:
        """Whether this process registered the rows with CUDA (see :meth:`pin`)."""
        return self._state.pinned_here()

    def pin(self, mode: str) -> bool:
        """Page-lock the rows for DMA in this process, per ``mode``; ``True`` if now pinned.

        ``off``: do nothing. ``auto``: pin when CUDA is usable (torch is not imported on a
        machine without an NVIDIA driver), else stay pageable. ``on``: pin or raise
        :class:`KvtierError`. Called by the process that copies to or from a GPU (the worker;
        pinning is per process); it blocks while the driver locks every page. Pinning twice
        is a no-op.
        """
        if mode not in PIN_MEMORY_CHOICES:
            raise ConfigError("pin_memory", mode, "one of " + ", ".join(PIN_MEMORY_CHOICES))
        self._live_rows()
        if self._state.pinned_here():
            return True
        if mode == "off":
            return False
        if not _cuda.cuda_available():
            if mode == "on":
                raise KvtierError(
                    f"pin_memory is 'on' but CUDA is not available, so {self._path} cannot "
                    f"be pinned; use pin_memory 'auto' or 'off' on a machine without a GPU"
                )
            return False
        registered: list[int] = []
        for start, size in pin_chunks(self._address, self.nbytes, PIN_CHUNK_BYTES):
            if not _cuda.host_register(start, size):
                for ptr in registered:  # all or nothing
                    _cuda.host_unregister(ptr)
                break
            registered.append(start)
        else:
            self._state.pinned_ptrs = tuple(registered)
            self._state.pinned_pid = os.getpid()
            return True
        if mode == "on":
            raise KvtierError(
                f"pin_memory is 'on' but cudaHostRegister of {self._path} ({self.nbytes} "
                f"bytes) failed (see the warning above); use pin_memory 'auto' to run unpinned"
            )
        return False

    def close(self) -> None:
        """Unpin, unmap and, for the creator, remove the file. Idempotent; never raises.

        Called by the owner at shutdown, on any thread, once no transfer uses the rows. If
        numpy views of the rows are still alive the mapping stays until they die, but the
        file is removed regardless.
        """
        self._finalizer()

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "open")
        return (
            f"SharedRegion({self._path!r}, num_rows={self._num_rows}, row_bytes={self._row_bytes}, {state})"
        )

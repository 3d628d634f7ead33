"""A disk tier's store directory: what opening it checks, its manifest, its locks.

Opening a store, in order (:meth:`kvtier.tiers.disk.base.DiskTier.open` drives it): check the
directory (:func:`prepare_directory`: never a symlink; a kvtier store or an empty directory,
known before anything is created or changed; created if its parent exists; a clear
:class:`~kvtier.errors.ConfigError` for a missing parent, a file in the way, a read-only or
unwritable directory); claim the path in this process (:func:`claim_path`); take the store's
locks and learn whether any other process has it open (:class:`StoreLocks`); read, write or
replace the manifest (:func:`settle_manifest`: a non-kvtier directory that is not empty is
refused, a store of another layout wiped only when no other process uses it); decide
O_DIRECT (:func:`decide_direct`).

Two lock files coordinate processes (``flock``, released by the kernel if a process dies):
``kvtier-store.lock`` is held exclusively only while a process opens the store, and every
process that has the store open holds ``kvtier-users.lock`` shared. An opener that gets
``kvtier-users.lock`` exclusively is *alone*: it may recover what crashed processes left (slot
reservations, temp files), reconcile counters, resize, or wipe. (Rejected: pid files — a pid
is reused, and a crashed process leaves its file behind; a kernel lock cannot leak.)

Who calls it: the opener's thread, blocking by design; never the scheduler's hot path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import pwd
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from kvtier.base import OffloadKey
from kvtier.config import format_size
from kvtier.errors import ConfigError, DiskTierError, ManifestError
from kvtier.tiers.disk.blockio import RowIO, probe_o_direct
from kvtier.tiers.disk.config import DISK_MEDIA, DiskTierConfig, default_store_path, user_cache_root
from kvtier.tiers.disk.format import LayoutFingerprint, differing_part
from kvtier.tiers.disk.manifest import (
    MANIFEST_NAME,
    StoreManifest,
    read_manifest,
    write_manifest,
)

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MAX_WIPED_KEYS",
    "Wiped",
    "StoreLocks",
    "claim_path",
    "create_private",
    "decide_direct",
    "default_store_path",
    "empty_store",
    "make_private_dirs",
    "open_private",
    "own_entries",
    "open_private_dir",
    "open_store_directory",
    "pid_alive",
    "prepare_directory",
    "refuse_foreign_entries",
    "release_path",
    "settle_manifest",
    "store_directory_path",
    "store_os_fix",
    "user_cache_root",
]

logger = logging.getLogger(__name__)

_MAINTENANCE_LOCK = "kvtier-store.lock"
_USERS_LOCK = "kvtier-users.lock"
# Names an opener may find in a directory that is not a store yet: its own lock files (left by
# an opener that crashed before writing the manifest), probe files, and the manifest's
# temporary file (another opener creating the store at this moment).
_OWN_PREFIXES = (".kvtier-", MANIFEST_NAME + ".")
_OWN_NAMES = (_MAINTENANCE_LOCK, _USERS_LOCK)
_TRASH_PREFIX = ".kvtier-trash-"

# Paths open in this process. LMDB forbids opening one environment twice in a process (its
# fcntl locks are per process, so the second close would drop the first's locks), and two
# in-process tiers on one path would each believe they own the capacity.
_open_lock = threading.Lock()
_open_paths: set[str] = set()


#: every directory of a store (the store itself, index/, blocks/, blocks/xx/): its owner only
DIR_MODE = 0o700
#: every file of a store, lock files included: its owner only
FILE_MODE = 0o600
# O_NONBLOCK: an open never waits (a FIFO planted under a file's name would hang a plain
# open for reading); it changes nothing for regular files, the only kind accepted.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def open_private(name: str, flags: int, *, dir_fd: int) -> int:
    """Open the store file ``name`` relative to the directory ``dir_fd``, never through a
    symlink, as a regular file of this user's; a file created (or opened for writing) gets
    mode 0600 whatever the umask.

    Raises OSError: ELOOP for a symlink, ENXIO for a FIFO, device or directory, EPERM for a
    file another user owns (a store directory of this user's, mode 0700, holds none).
    """
    fd = os.open(name, flags | _OPEN_FLAGS, FILE_MODE, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.ENXIO, "not a regular file", name)
        if info.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by {_owner(info.st_uid)}, not by this user", name)
        if flags & os.O_ACCMODE != os.O_RDONLY and stat.S_IMODE(info.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(name: str, flags: int, *, dir_fd: int) -> int:
    """Create the new store file ``name`` (relative to ``dir_fd``; ``O_EXCL``: never an
    existing file, never through a symlink) and open it with ``flags``: mode 0600 whatever
    the umask.

    What :func:`open_private` checks after its open holds here by construction (a file this
    call created is a regular file of this user's), so a block's file costs no ``fstat``: one
    system call fewer per block written, each of which hands the GIL round the writer
    threads. Only its mode can differ, where the umask takes the owner's bits; then it is set.
    """
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, FILE_MODE, dir_fd=dir_fd)
    if not _umask_keeps(FILE_MODE):
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


@functools.cache
def _umask_keeps(mode: int) -> bool:
    """Whether this process's umask leaves ``mode`` whole, read from /proc once (never with
    ``os.umask``, which would change it for every thread for a moment); False if unknown.
    A umask changed later can only take bits away: a file is never more open than 0600."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return not int(line.split()[1], 8) & mode
    except (OSError, ValueError):
        pass
    return False


def open_private_dir(name: str, *, dir_fd: int, read_only: bool = False) -> int:
    """A descriptor of the store's subdirectory ``name`` (relative to ``dir_fd``), never
    through a symlink, this user's: created with mode 0700 if missing and made 0700 if it is
    not (``read_only``: neither; refused if group or others may write it). Raises OSError
    (FileNotFoundError when ``read_only`` and missing)."""
    if not read_only:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by {_owner(info.st_uid)}, not by this user", name)
        mode = stat.S_IMODE(info.st_mode)
        if read_only and mode & 0o022:
            raise OSError(errno.EPERM, f"mode {mode:o}: group or others may write in it", name)
        if not read_only and mode != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def directory_problem(info: os.stat_result, directory: str) -> tuple[str, str] | None:
    """``(what is wrong, the fix)`` for a store directory with ``info`` (an fstat), or None.

    Refused: a directory another user owns (they could read, plant or redirect what kvtier
    writes there, or squat the path before kvtier creates it), and one that group or others
    may write (they could replace or remove its files).
    """
    if info.st_uid != os.geteuid():
        what = (
            f"{directory} is owned by {_owner(info.st_uid)}, not by this user ({_owner(os.geteuid())}): "
            f"its owner could read, plant or redirect the KV blocks kvtier keeps there"
        )
        fix = (
            f"use a directory of your own (such as {user_cache_root()}/NAME, which kvtier creates), "
            f"or remove {directory} if it should not exist"
        )
        return what, fix
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        what = f"{directory} has mode {mode:o}: group or others may write in it, so they could replace or remove its files"
        return (
            what,
            f"chmod 700 {directory} if every file in it is yours, or remove it and let kvtier recreate it",
        )
    return None


def open_store_directory(directory: str, field: str, path: str, *, read_only: bool = False) -> int:
    """A descriptor of the store directory (not through a symlink), after checking that this
    user owns it, no one else may write in it, and it is a kvtier store or empty: nothing is
    changed before that is known. A store others may read is made 0700 (not ``read_only``);
    an empty directory kvtier did not create is refused unless it is 0700 already (kvtier
    never changes the mode of a directory that is not its own). Raises ConfigError naming
    ``<field>.path``, what is wrong and the fix."""
    where = f"{field}.path"
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(where, path, "a store directory kvtier can open", _os_fix(exc, directory)) from None
    try:
        info = os.fstat(fd)
        problem = directory_problem(info, directory)
        if problem is not None:
            raise ConfigError(
                where,
                path,
                "a store directory of this user's that no one else may write",
                f"{problem[0]}. Fix: {problem[1]}",
            )
        is_store = refuse_foreign_entries(os.listdir(fd), field, path)
        mode = stat.S_IMODE(info.st_mode)
        if not read_only and mode != DIR_MODE:
            if not is_store:
                raise ConfigError(
                    where,
                    path,
                    f"a directory of mode {DIR_MODE:o}, or a path where kvtier creates one",
                    f"{directory} has mode {mode:o} and holds no kvtier store; kvtier changes the "
                    f"mode only of its own directories. Fix: chmod {DIR_MODE:o} {directory}, or "
                    f"remove it and let kvtier create it",
                )
            # others may read it (a store kvtier made before it used 0700): its files are KV
            logger.warning(
                "kvtier: store directory %s had mode %o; set to %o (KV blocks are for this user only)",
                directory,
                mode,
                DIR_MODE,
            )
            os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_foreign_entries(names: list[str], field: str, path: str) -> bool:
    """Whether the directory holding ``names`` is a kvtier store (it has a manifest); a
    ConfigError if it is not and holds anything but what an opener leaves (its lock and
    probe files): kvtier never writes into, nor deletes from, a directory of other files."""
    if MANIFEST_NAME in names:
        return True
    foreign = [name for name in names if name not in _OWN_NAMES and not name.startswith(_OWN_PREFIXES)]
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise ConfigError(
            f"{field}.path",
            path,
            "an empty directory or a kvtier store (it has no kvtier-store.json)",
            f"it holds other files ({shown}); kvtier never deletes files it did not write, "
            f"nor writes among them: choose an empty or new directory",
        )
    return False


def _mkdir_private(directory: str) -> None:
    """Create ``directory`` with mode 0700 whatever the umask (FileExistsError if it exists);
    the mode is set through a descriptor, so a symlink swapped in meanwhile is not followed."""
    os.mkdir(directory, DIR_MODE)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def make_private_dirs(directory: str) -> None:
    """Create ``directory`` and its missing parents, each 0700 whatever the umask."""
    parent = os.path.dirname(directory)
    if parent and parent != directory and not os.path.isdir(parent):  # "" above a relative path
        make_private_dirs(parent)
    with contextlib.suppress(FileExistsError):
        _mkdir_private(directory)


#: in each scratch folder: the file its owner holds locked (flock) for as long as it lives
SCRATCH_OWNER = ".kvtier-scratch-owner"


@contextlib.contextmanager
def scratch_directory(prefix: str) -> Iterator[str]:
    """A throwaway folder for a command's own stores, removed when it exits: in this user's
    cache folder (on disk, where ``/tmp`` is often memory; 0700, whatever the working
    directory). :class:`ConfigError` naming the folder if it cannot be made there.

    Its owner holds :data:`SCRATCH_OWNER` locked while it lives; a folder whose owner died
    before removing it (SIGKILL, the OOM killer, a clean-up past its deadline) has that file
    unlocked, and the next scratch folder made under the same root removes it first."""
    root = user_cache_root()
    folder = None
    try:
        make_private_dirs(root)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _remove_abandoned(root, root_fd)
            folder = tempfile.mkdtemp(prefix=prefix, dir=root)
            owner_file = os.path.join(os.path.basename(folder), SCRATCH_OWNER)
            # locked under another name, then renamed: a sweep never sees it unlocked
            owner = create_private(owner_file + ".new", os.O_RDWR, dir_fd=root_fd)
            try:
                fcntl.flock(owner, fcntl.LOCK_EX)
                os.rename(owner_file + ".new", owner_file, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            except BaseException:
                os.close(owner)
                raise
        finally:
            os.close(root_fd)
    except OSError as exc:
        if folder is not None:  # made, but never owned: no sweep would ever remove it
            shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(
            "XDG_CACHE_HOME",
            root,
            f"a folder on disk this user can write, for a temporary store ({exc.strerror or exc})",
            "set XDG_CACHE_HOME to one, or give --config a stack of your own",
        ) from None
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(owner)


def _remove_abandoned(root: str, root_fd: int) -> None:
    """Remove the scratch folders under ``root`` (open as ``root_fd``) whose owner is gone
    (see :func:`scratch_directory`): each one's owner file, a regular file of this user's,
    is locked here first, so a folder in use is never touched."""
    with os.scandir(root_fd) as entries:
        names = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
    for name in names:
        try:
            fd = open_private(os.path.join(name, SCRATCH_OWNER), os.O_RDONLY, dir_fd=root_fd)
        except OSError:
            continue  # not a scratch folder (a model cache, say), or gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner lives
        try:
            folder = os.path.join(root, name)
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("kvtier: removed %s, a temporary store whose command died before removing it", folder)
        finally:
            os.close(fd)


def store_directory_path(path: str, where: str) -> str:
    """The absolute path of the store ``path`` names, its parent resolved (one store reached
    through a symlinked parent is still one store); a ConfigError if ``path`` itself is a
    symlink: whoever may write its folder could aim it at any directory, and kvtier would
    lock, chmod or fill what it points at."""
    parent, name = os.path.split(os.path.abspath(os.path.expanduser(path)))
    directory = os.path.join(os.path.realpath(parent), name)
    if os.path.islink(directory):
        raise ConfigError(
            where,
            path,
            "a directory, not a symlink",
            f"{directory} is a symlink (to {os.readlink(directory)}); kvtier never follows one "
            f"as a store path: give the directory's own path",
        )
    return directory


def claim_path(directory: str) -> None:
    """Mark ``directory`` open as a tier in this process; DiskTierError if it already is."""
    with _open_lock:
        if directory in _open_paths:
            raise DiskTierError(
                f"{directory} is already open as a disk tier in this process; share that "
                f"tier object, or close it before opening the path again"
            )
        _open_paths.add(directory)


def release_path(directory: str) -> None:
    """Undo :func:`claim_path` (idempotent)."""
    with _open_lock:
        _open_paths.discard(directory)


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
        return (
            f"{where} is on a read-only filesystem: remount it read-write or choose a path on a writable disk"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"this user (uid {os.getuid()}) may not write in {where}: fix its ownership or "
            f"permissions, or choose another path"
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the filesystem of {where} is full: free space there or choose another disk"
    return f"fix {where} ({exc.strerror})"


def store_os_fix(exc: OSError, directory: str) -> str:
    """What went wrong with a file of the store in ``directory``, and the fix."""
    name = os.path.join(directory, str(exc.filename)) if exc.filename else directory
    if exc.errno == errno.ELOOP:
        return (
            f"{name} is a symlink, and kvtier never follows one inside a store (it could point "
            f"anywhere); remove it, or remove {directory} and let kvtier recreate it"
        )
    if exc.errno in (errno.ENXIO, errno.EPERM) and exc.filename:
        return (
            f"{name}: {exc.strerror}; kvtier keeps only regular files and directories of its "
            f"own user in a store: remove it, or remove {directory} and let kvtier recreate it"
        )
    return _os_fix(exc, name)


class StoreLocks:
    """The maintenance and users locks of one store directory (see the module docstring).

    Both files are 0600 in a 0700 directory: no other user can open them, let alone hold
    them. A process of this user that holds the maintenance lock longer than ``timeout_s``
    makes the open fail with an error naming the lock (never a silent wait without end).
    """

    def __init__(self, dir_fd: int, directory: str, *, timeout_s: float = 60.0, read_only: bool = False):
        self._maintenance = self._users = -1
        #: no other process has the store open
        self.alone = True
        try:
            self._maintenance = self._open(dir_fd, _MAINTENANCE_LOCK, read_only)
            if self._maintenance >= 0:  # held for the few ms of an open
                _flock_within(self._maintenance, os.path.join(directory, _MAINTENANCE_LOCK), timeout_s)
            self._users = self._open(dir_fd, _USERS_LOCK, read_only)
        except BaseException:
            self.close()
            raise
        if self._users >= 0:
            try:
                fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.alone = False

    @staticmethod
    def _open(dir_fd: int, name: str, read_only: bool) -> int:
        """The lock file's descriptor; read-only (``kvtier check``): never created, and -1 if
        missing (every process that opens a store creates both, so nobody has it open)."""
        if not read_only:
            return open_private(name, os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
        try:
            return open_private(name, os.O_RDONLY, dir_fd=dir_fd)  # flock needs no write access
        except FileNotFoundError:
            return -1

    def share(self) -> None:
        """Become an ordinary user and let the next opener in.

        Converting EX to SH is not atomic in flock, but nobody can observe the gap: every
        opener takes the maintenance lock, which is released only afterwards.
        """
        if self._users >= 0:
            fcntl.flock(self._users, fcntl.LOCK_SH)
        if self._maintenance >= 0:
            fcntl.flock(self._maintenance, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._maintenance, self._users):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._maintenance = self._users = -1


def _flock_within(fd: int, path: str, timeout_s: float) -> None:
    """flock ``fd`` exclusively, waiting at most ``timeout_s``; DiskTierError naming ``path`` after."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise DiskTierError(
                f"timed out after {timeout_s:g} s (lock_timeout_s) waiting for the lock {path}: "
                f"another process of this user holds it (opening or checking the store) and does "
                f"not let go. Find it with `fuser -v {path}`; stop it if it hangs, or raise "
                f"lock_timeout_s if opens of this store are slow (a wipe or scan of a large store)"
            )
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)


def prepare_directory(path: str, field: str, *, read_only: bool = False) -> str:
    """The store's absolute path (see :func:`store_directory_path`), created if its parent
    exists, checked by :func:`open_store_directory` and proven writable (``read_only``: only
    proven to be a directory; nothing is created or written)."""
    where = f"{field}.path"
    directory = store_directory_path(path, where)
    if read_only:
        if not os.path.isdir(directory):
            raise ConfigError(where, path, "an existing store directory", f"{directory} is not a directory")
        return directory
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(
            where,
            path,
            "a directory (or where to create one)",
            f"{directory} is a file: point path at a directory",
        )
    if not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        try:
            if not os.path.isdir(parent):
                if parent not in (user_cache_root(), os.path.expanduser("~/.cache/kvtier")):
                    raise ConfigError(
                        where,
                        path,
                        "a directory whose parent exists",
                        f"create {parent} first (kvtier creates only the last path component, "
                        f"and the missing parents of its per-user default {user_cache_root()})",
                    )
                make_private_dirs(parent)
            _reject_open_parent(parent, where, path)
            _mkdir_private(directory)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(where, path, "a directory kvtier can create", _os_fix(exc, parent)) from None
    dir_fd = open_store_directory(directory, field, path)
    probe = f".kvtier-write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, FILE_MODE, dir_fd=dir_fd)
        try:
            os.write(fd, b"kvtier")
        finally:
            os.close(fd)
        os.unlink(probe, dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(probe, dir_fd=dir_fd)
        raise ConfigError(where, path, "a directory kvtier can write", _os_fix(exc, directory)) from None
    finally:
        os.close(dir_fd)
    return directory


def _reject_open_parent(parent: str, where: str, path: str) -> None:
    """Refuse to create a store in a directory anyone may write without the sticky bit: any
    user could rename the new store away and put their own in its place."""
    info = os.stat(parent)
    if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
        raise ConfigError(
            where,
            path,
            "a path whose parent directory other users cannot rewrite",
            f"{parent} is writable by everyone without the sticky bit; use a directory of your "
            f"own, such as {user_cache_root()}/NAME",
        )


def settle_manifest(
    directory: str,
    kind: str,
    medium_names: tuple[str, ...],
    config: DiskTierConfig,
    fingerprint: LayoutFingerprint,
    alone: bool,
    field: str,
    *,
    read_only: bool = False,
    stored_keys: Callable[[str, int], list[OffloadKey]] | None = None,
    keep_keys: int = 0,
    key_id: int | None = None,
) -> tuple[StoreManifest, bool, Wiped | None]:
    """Read, create or replace the manifest of a ``kind`` store; ``(manifest, created,
    wiped)``.

    Under the maintenance lock. ``medium_names`` are the directory entries the medium owns
    (removed when a store of another layout is wiped). ``read_only``: the manifest must
    exist and match ``kind`` and ``fingerprint``; nothing is written. ``wiped``: when a store
    of another layout was wiped, the part of the layout that differed and up to
    ``keep_keys`` of the keys it held (``stored_keys(directory, keep_keys)``, read before the
    wipe; none by default), so their misses can be told as ``foreign``, not ``new``.

    ``key_id``: the id of the opener's secret (0: none), recorded in the manifest; a store
    keyed under a secret is refused to an opener without one (every block would fail its
    check and be dropped). None (``kvtier check``): not compared, the check reports such
    blocks.
    """
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise ConfigError(
            f"{field}.path", config.path, "a kvtier store or an empty directory", str(exc)
        ) from None
    if read_only:
        if manifest is None or manifest.kind != kind or manifest.fingerprint.digest() != fingerprint.digest():
            raise ConfigError(
                f"{field}.path",
                config.path,
                f"a {kind} store of layout ({fingerprint.describe()})",
                f"{directory}/{MANIFEST_NAME} is missing or describes another store",
            )
        return manifest, False, None
    if manifest is None:
        refuse_foreign_entries(os.listdir(directory), field, str(config.path))
        manifest = StoreManifest.new(kind, fingerprint, config.capacity_bytes, key_id or 0)
        _write_manifest(directory, manifest, config, field)
        return manifest, True, None
    if manifest.kind != kind:
        raise ConfigError(
            f"{field}.kind",
            config.kind,
            f"'{manifest.kind}': {directory} holds a {manifest.kind} store",
            f"set kind: {manifest.kind}, or point path at another directory (or remove "
            f"{directory} to start a {kind} store there)",
        )
    if manifest.fingerprint.digest() != fingerprint.digest():
        if not alone:
            raise ConfigError(
                f"{field}.path",
                config.path,
                "a store of this engine's layout, or one no other process is using",
                f"another process uses {directory} with layout ({manifest.fingerprint.describe()}), "
                f"this one is ({fingerprint.describe()}): give each layout its own path",
            )
        # Wiped rather than moved aside: a cache is recomputable, nothing would ever read
        # an aside copy back, and keeping it would hold disk space outside any capacity
        # (each model switch would leave another copy, until the disk is full).
        part = differing_part(fingerprint.to_dict(), manifest.fingerprint.to_dict())
        wiped = Wiped(part, _keys_before_wipe(stored_keys, keep_keys, directory, config.name))
        logger.warning(
            "kvtier tier %s: %s holds blocks of another layout (%s); this engine's layout is "
            "(%s). Serving none of them: wiping the old blocks and starting empty%s.",
            config.name,
            directory,
            manifest.fingerprint.describe(),
            fingerprint.describe(),
            f" (misses of {len(wiped.keys)} of them count as foreign_{part})" if wiped.keys else "",
        )
        _wipe(directory, medium_names)
        manifest = StoreManifest.new(kind, fingerprint, config.capacity_bytes, key_id or 0)
        _write_manifest(directory, manifest, config, field)
        return manifest, True, wiped
    if key_id == 0 and manifest.key_id:
        raise ConfigError(
            f"{field}.secret_file",
            None,
            "the secret the store's blocks were written with",
            f"{directory} holds blocks keyed under a secret: without it each would fail its "
            f"check and be dropped. Give the tier that secret_file, or another path (or remove "
            f"{directory} to start over without a secret)",
        )
    if key_id and manifest.key_id != key_id:  # keyed from now on (another secret's blocks: foreign)
        manifest = dataclasses.replace(manifest, key_id=key_id)
        _write_manifest(directory, manifest, config, field)
    if manifest.capacity_bytes != config.capacity_bytes:
        if not alone:
            raise ConfigError(
                f"{field}.capacity",
                format_size(config.capacity_bytes),
                f"{format_size(manifest.capacity_bytes)}, the capacity another process uses {directory} with",
                "give every process sharing a path the same capacity (or its own path)",
            )
        manifest = dataclasses.replace(manifest, capacity_bytes=config.capacity_bytes)
        _write_manifest(directory, manifest, config, field)
    if alone:
        _remove_trash(directory)
    return manifest, False, None


@dataclasses.dataclass(frozen=True)
class Wiped:
    """What a store of another layout held when it was wiped (see :func:`settle_manifest`)."""

    #: the part of the layout that differed (``tp`` or ``layout``, as
    #: :func:`~kvtier.tiers.disk.format.differing_part` names it)
    part: str
    #: keys the store held (as many as the opener asked to keep, at most)
    keys: list[OffloadKey]


def own_entries(directory: str, names: tuple[str, ...]) -> bool:
    """Whether ``directory`` is a directory of this user's (not a symlink, not writable by
    others) and each of ``names`` in it is absent or a regular file of this user's: the
    checks of :func:`open_private_dir` and :func:`open_private`, read-only."""
    parent, name = os.path.split(directory)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = open_private_dir(name, dir_fd=parent_fd, read_only=True)
        try:
            for entry in names:
                with contextlib.suppress(FileNotFoundError):
                    os.close(open_private(entry, os.O_RDONLY, dir_fd=fd))
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.close(parent_fd)
    return True


def _keys_before_wipe(
    stored_keys: Callable[[str, int], list[OffloadKey]] | None, limit: int, directory: str, name: str
) -> list[OffloadKey]:
    if stored_keys is None or limit <= 0:
        return []  # nobody counts miss causes: nothing is listed
    try:
        return stored_keys(directory, limit)
    except Exception as exc:  # a diagnosis only: an unreadable old index never fails the open
        logger.info("kvtier tier %s: could not list the wiped store's keys: %s", name, exc)
        return []


#: the most keys of a wiped store a stack with miss causes keeps (as ``foreign``): listing
#: and remembering this many takes 0.3-0.6 s at open and ~21 MB until the stack takes them
MAX_WIPED_KEYS = 1 << 18


def _write_manifest(directory: str, manifest: StoreManifest, config: DiskTierConfig, field: str) -> None:
    try:
        write_manifest(directory, manifest)
    except OSError as exc:
        raise ConfigError(
            f"{field}.path", config.path, "a directory kvtier can write", _os_fix(exc, directory)
        ) from None


def _wipe(directory: str, medium_names: tuple[str, ...]) -> None:
    """Remove the medium's entries: first renamed into one trash directory (atomic, so a
    crash mid-way never leaves half a store under the live names), then deleted."""
    trash = os.path.join(directory, f"{_TRASH_PREFIX}{secrets.token_hex(4)}")
    os.mkdir(trash, DIR_MODE)
    for name in medium_names:
        source = os.path.join(directory, name)
        if os.path.lexists(source):
            os.rename(source, os.path.join(trash, name))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, MANIFEST_NAME))
    shutil.rmtree(trash, ignore_errors=True)


def empty_store(path: str, field: str, timeout_s: float = 60.0) -> bool:
    """Empty the kvtier store at ``path`` (``kvtier replay --fresh``): its blocks and manifest
    go as when a store of another layout is wiped at open; its lock files stay. False, with
    nothing touched, where there is no store. ConfigError naming ``<field>.path`` for a
    directory that is not a kvtier store (kvtier never deletes files it did not write) or a
    store another process has open."""
    directory = store_directory_path(path, f"{field}.path")
    if not os.path.isdir(directory):
        return False
    dir_fd = open_store_directory(directory, field, path)  # this user's own, a store or empty
    try:
        locks = StoreLocks(dir_fd, directory, timeout_s=timeout_s)
        try:
            try:
                manifest = read_manifest(directory)
            except ManifestError as exc:
                raise ConfigError(
                    f"{field}.path", path, "a kvtier store or an empty directory", str(exc)
                ) from None
            if manifest is None:
                return False
            if not locks.alone:
                raise ConfigError(
                    f"{field}.path",
                    path,
                    "a store no other process has open",
                    "stop the engine using it, or give the replay a stack of its own",
                )
            _wipe(directory, DISK_MEDIA.resolve(manifest.kind, field=f"{field}.kind").medium_names)
            return True
        finally:
            locks.close()
    finally:
        os.close(dir_fd)


def _remove_trash(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(_TRASH_PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def decide_direct(
    config: DiskTierConfig, directory: str, rowio: RowIO, field: str
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
            f"{field}.o_direct",
            "on",
            f"O_DIRECT usable in {config.path}",
            f"{problem}: set o_direct: auto (falls back to buffered I/O, logged) or off, "
            f"or put the store on a filesystem that supports O_DIRECT",
        )
    return False, problem

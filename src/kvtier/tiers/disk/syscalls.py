"""The Linux-only calls the ``files`` tier uses beyond :mod:`os`: syncfs, renameat2, fallocate,
and the directory flag that spreads its fan-out directories.

syncfs, renameat2 and fallocate are None where libc lacks them (another OS, an old libc); the
tier then falls back (fdatasync per file, link + unlink, no allocation ahead of a write).
"""

from __future__ import annotations

import ctypes
import fcntl
import struct

__all__ = ["RENAME_NOREPLACE", "fallocate", "renameat2", "spread_subdirectories", "syncfs"]


def _libc_function(name: str, argtypes: list):
    """A libc function by name (Linux-only ones: syncfs, renameat2), or None where there is none."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


syncfs = _libc_function("syncfs", [ctypes.c_int])
renameat2 = _libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)
RENAME_NOREPLACE = 1
# the system call itself (mode, offset, length), never glibc's posix_fallocate, which where a
# filesystem lacks it writes the range instead
fallocate = _libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])

# linux/fs.h: the inode flags ioctls and the "top of a directory hierarchy" flag
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_TOPDIR_FL = 0x00020000


def spread_subdirectories(fd: int) -> bool:
    """Mark directory ``fd`` as the top of a hierarchy (``chattr +T``), so that ext2/3/4 place
    the directories made in it afterwards apart, in block groups of their own, as they place
    directories made at a filesystem's root; whether the flag is set. Best effort: False on a
    filesystem without the flag.

    Why: on ext4 a new file's inode is taken from its directory's block group, and where the
    filesystem has no journal the allocator steps over every inode freed there in the last
    minutes, each looked up in the buffer cache. Fan-out directories made next to their
    parent share its group with everything else created and deleted around it (/var/tmp, a
    home directory), and a file creation there costs many times what it costs apart
    (docs/design/disk.md#fan-out-directories-apart).
    """
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 4))[0]
        if not flags & _FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_TOPDIR_FL))
    except OSError:  # ENOTTY, EOPNOTSUPP, EINVAL: not a filesystem with the flag
        return False
    return True

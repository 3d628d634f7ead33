"""What a store's drive has written: the block device under a path, its write counter, its size.

``/sys/block/<dev>/stat`` counts every write to the drive since boot, whoever made it, in
512-byte sectors (the 7th field, whatever the drive's own sector size). A path is mapped to it
through its filesystem's device number: ``st_dev`` -> ``MAJ:MIN`` -> ``/sys/dev/block/MAJ:MIN``;
a partition counts as its parent disk (the wear is the drive's), and a device-mapper or md
device built on one device as that device. A path on no block device (tmpfs, overlay, a
container without ``/sys``) has no counter: the write budget then counts the tier's own bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DeviceWriteCounter", "block_device_dir", "filesystem_bytes", "sectors_written"]

#: ``/sys/block/<dev>/stat`` counts in 512-byte units, whatever the drive's sector size
SECTOR_BYTES = 512
#: zero-based index of "sectors written" among the stat file's fields
_WRITE_SECTORS_FIELD = 6
#: device-mapper or md chains followed at most this deep (a loop would be a kernel bug)
_MAX_HOPS = 8


def sectors_written(stat_text: str) -> int:
    """The sectors-written field of a ``/sys/block/<dev>/stat`` line; ``ValueError`` if the
    text is not such a line."""
    fields = stat_text.split()
    if len(fields) <= _WRITE_SECTORS_FIELD or not all(f.isdigit() for f in fields):
        raise ValueError(f"not a block device stat line: {stat_text[:120]!r}")
    return int(fields[_WRITE_SECTORS_FIELD])


def block_device_dir(path: str | os.PathLike[str], sys_root: str = "/sys") -> Path | None:
    """The ``/sys`` directory of the drive holding ``path`` (one with a ``stat`` file), or
    None when ``path`` is on no block device this host shows (tmpfs, overlay, no ``/sys``)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    link = Path(sys_root) / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        here = link.resolve(strict=True)
    except OSError:
        return None  # major 0 (tmpfs, overlay) has no entry
    for _ in range(_MAX_HOPS):
        if (here / "partition").exists():
            here = here.parent  # a partition's directory sits inside its disk's
            continue
        slaves = here / "slaves"
        below = sorted(slaves.iterdir()) if slaves.is_dir() else []
        if len(below) == 1:  # dm-crypt, LVM on one device: the writes land on that one
            here = below[0].resolve()
            continue
        break
    return here if (here / "stat").is_file() else None


def filesystem_bytes(path: str | os.PathLike[str]) -> int:
    """The size of the filesystem holding ``path``, in bytes (``statvfs``)."""
    found = os.statvfs(path)
    return found.f_blocks * found.f_frsize


class DeviceWriteCounter:
    """Bytes the drive under a path has written since boot, read from ``/sys`` on each call.

    Built with :meth:`for_path`, which answers None where there is no such counter.
    """

    def __init__(self, stat_path: Path):
        self.stat_path = stat_path
        #: the drive's name in ``/sys/block`` (``nvme0n1``, ``sda``), for logs and docs
        self.device = stat_path.parent.name

    @classmethod
    def for_path(cls, path: str | os.PathLike[str], sys_root: str = "/sys") -> DeviceWriteCounter | None:
        found = block_device_dir(path, sys_root)
        if found is None:
            return None
        counter = cls(found / "stat")
        return counter if counter.written_bytes() is not None else None

    def written_bytes(self) -> int | None:
        """Bytes written to the drive since boot; None if the counter cannot be read now."""
        try:
            return sectors_written(self.stat_path.read_text()) * SECTOR_BYTES
        except (OSError, ValueError):
            return None

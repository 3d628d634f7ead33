"""Real filesystems for the fault tests: a small tmpfs, and ext4 on a loop device.

Mounting needs root (CI runs as root); where it is not permitted the tests skip and say why.
Each helper undoes what it did, also when the test fails.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["ext4", "fill", "fs_error", "remount", "shutdown", "tmpfs"]

# EXT4_IOC_SHUTDOWN = _IOR('X', 125, __u32); flag 2 = EXT4_GOING_FLAGS_NOLOGFLUSH: the
# filesystem stops at once, as after a device failure, and every later I/O on it is EIO.
_EXT4_IOC_SHUTDOWN = 0x8004587D
_GOING_NOLOGFLUSH = 2


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, check=False)


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root (CI runs these as root)")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``4m``) mounted at ``path`` (created) for the block."""
    _need_root()
    path.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def ext4(image: Path, path: Path, size_mib: int = 64) -> Iterator[Path]:
    """An ext4 filesystem in file ``image`` on a loop device, mounted at ``path``.

    Mounted ``errors=remount-ro``, as most distributions mount root: an error found by the
    filesystem makes it read-only at once. Use :func:`remount` to unmount, repair (e2fsck)
    and mount again, the way an operator recovers. Skips without a loop device or mkfs.ext4.
    """
    _need_root()
    if shutil.which("mkfs.ext4") is None or shutil.which("e2fsck") is None:
        pytest.skip("no mkfs.ext4/e2fsck on this machine")
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("no loop devices here (/dev/loop-control is missing)")
    with open(image, "wb") as stream:
        stream.truncate(size_mib << 20)
    done = _run("mkfs.ext4", "-q", "-F", str(image))
    if done.returncode:
        pytest.skip(f"mkfs.ext4 failed here: {done.stderr.strip()}")
    path.mkdir(parents=True, exist_ok=True)
    _mount_ext4(image, path)
    try:
        yield path
    finally:
        _run("umount", str(path))


def _mount_ext4(image: Path, path: Path) -> None:
    done = _run("mount", "-o", "loop,errors=remount-ro", str(image), str(path))
    if done.returncode:
        pytest.skip(f"cannot mount ext4 on a loop device here: {done.stderr.strip()}")


def remount(image: Path, path: Path) -> str:
    """Unmount, repair with ``e2fsck -fy``, mount again; e2fsck's last line."""
    done = _run("umount", str(path))
    assert done.returncode == 0, f"umount {path}: {done.stderr} (something still holds it open)"
    repaired = _run("e2fsck", "-fy", str(image))
    assert repaired.returncode in (0, 1), repaired.stdout + repaired.stderr  # 1: errors fixed
    _mount_ext4(image, path)
    return repaired.stdout.strip().splitlines()[-1]


def _device_name(path: Path) -> str:
    done = _run("findmnt", "-n", "-o", "SOURCE", str(path))
    assert done.returncode == 0, done.stderr
    return os.path.basename(done.stdout.strip())


def fs_error(path: Path) -> None:
    """Make the ext4 at ``path`` hit an error of its own (``trigger_fs_error``): mounted
    ``errors=remount-ro``, the kernel turns it read-only, while every file stays open."""
    control = f"/sys/fs/ext4/{_device_name(path)}/trigger_fs_error"
    if not os.path.exists(control):
        pytest.skip(f"this kernel has no {control}")
    with open(control, "w") as stream:
        stream.write("kvtier fault test")


def shutdown(path: Path) -> None:
    """Stop the ext4 at ``path`` as a failed device would: every I/O on it is EIO from now."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _GOING_NOLOGFLUSH))
    except OSError as exc:
        pytest.skip(f"EXT4_IOC_SHUTDOWN is not available here: {exc.strerror}")
    finally:
        os.close(fd)


def fill(path: Path) -> Path:
    """Another process's file that takes every free byte of ``path``'s filesystem."""
    filler = path / "filler"
    chunk = b"\xa5" * (1 << 16)
    with open(filler, "wb", buffering=0) as stream:
        try:
            while True:
                stream.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        # the last partial chunk: byte by byte is slow, halves are enough
        size = len(chunk) // 2
        while size:
            try:
                stream.write(chunk[:size])
            except OSError:
                size //= 2
    stats = os.statvfs(path)
    assert stats.f_bavail == 0, f"{stats.f_bavail} blocks still free"
    return filler

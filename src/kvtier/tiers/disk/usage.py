"""The ``usage`` file of a ``files`` store: the room its blocks take, shared by every process.

In blocks, or in pages where blocks take their own size (a codec of varying size).

Room is reserved (count raised) before a block is written and given back if it is not
published; a file is unlinked before the count is lowered, so a crash leaves the count too
high, never too low (see :mod:`kvtier.tiers.disk.files`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading

from kvtier.tiers.disk.store import open_private

__all__ = ["SharedCount"]

_COUNT = struct.Struct("<Q")


class SharedCount:
    """The store's count (blocks or pages) shared by every process: a u64 in a file.

    Changed under ``flock`` (other processes) and a thread lock (``flock`` is per open file,
    so it does not exclude this process's own threads). Any thread; blocks for a few syscalls.
    """

    def __init__(self, name: str, *, dir_fd: int, read_only: bool = False):
        if read_only:  # `kvtier check`: read the count, never create or write it
            try:
                self._fd = open_private(name, os.O_RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                self._fd = os.open(os.devnull, os.O_RDONLY)  # reads as 0
        else:
            self._fd = open_private(name, os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
        self._lock = threading.Lock()

    def _update(self, change) -> tuple[int, int]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _COUNT.size, 0)
                value = _COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else 0
                result, new = change(value)
                if new != value:
                    os.pwrite(self._fd, _COUNT.pack(new), 0)
                return result, new
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def get(self) -> int:
        return self._update(lambda value: (value, value))[1]

    def set(self, value: int) -> None:
        self._update(lambda _: (None, value))

    def add(self, delta: int) -> int:
        return self._update(lambda value: (None, max(0, value + delta)))[1]

    def reserve(self, wanted: int, capacity: int, step: int = 1) -> tuple[int, int]:
        """Raise the count by up to ``wanted`` (a multiple of ``step``) within ``capacity``,
        in whole steps; ``(granted, count after)``."""

        def change(value: int) -> tuple[int, int]:
            granted = max(0, min(wanted, (capacity - value) // step * step))
            return granted, value + granted

        return self._update(change)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

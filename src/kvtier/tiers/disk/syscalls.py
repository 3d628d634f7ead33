"""The Linux-only libc calls the ``files`` tier uses beyond :mod:`os`: syncfs and renameat2.

Each is None where libc lacks it (another OS, an old libc); the tier then falls back
(fdatasync per file, link + unlink).
"""

from __future__ import annotations

import ctypes

__all__ = ["RENAME_NOREPLACE", "renameat2", "syncfs"]


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

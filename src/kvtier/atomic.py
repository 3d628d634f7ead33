"""Replacing a small file whole: readers see the old contents or the new, never half, and
nobody but its user can read it (a manifest, a stats snapshot)."""

from __future__ import annotations

import os
import secrets

__all__ = ["replace_file"]


def replace_file(path: str, data: bytes, *, durable: bool) -> None:
    """Write ``data`` to a new temporary file beside ``path`` (mode 0600, created exclusively
    under a random name, never through a symlink), then rename it over ``path``; with
    ``durable`` the file is fsynced first (the caller fsyncs the folder for the rename).
    Raises ``OSError``; the temporary file is removed on any failure."""
    temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: the file is its user's alone
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise

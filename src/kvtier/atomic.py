"""Replacing a small file whole: readers see the old contents or the new, never half, and
nobody but its user can read it (a manifest, a stats snapshot); and the check that its folder
lets no one else swap it (:func:`check_private_parent`)."""

from __future__ import annotations

import os
import secrets
import stat

from kvtier.errors import ConfigError

__all__ = ["check_private_parent", "replace_file"]


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


def check_private_parent(path: str, field: str) -> None:
    """Refuse (a :class:`ConfigError` naming ``field``) a file path whose folder is missing,
    owned by another user than this one or root, or writable by group or others: they could
    remove what kvtier writes there and put their own file, link or socket in its place."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        info = os.stat(parent)
    except OSError as exc:
        raise ConfigError(
            field, path, "a path in an existing folder", f"create {parent} ({exc.strerror})"
        ) from None
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (os.geteuid(), 0) or mode & 0o022:
        who = f"owned by uid {info.st_uid}" if info.st_uid not in (os.geteuid(), 0) else f"mode {mode:o}"
        raise ConfigError(
            field,
            path,
            "a path in a folder only this user (or root) may write",
            f"{parent} is {who}, so another user could swap the file for one of theirs: use a "
            f"folder of your own, such as /run/user/{os.geteuid()} or ~/.cache/kvtier",
        )

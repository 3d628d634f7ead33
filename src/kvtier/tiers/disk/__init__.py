"""The local disk tiers (``lmdb``, ``files``) and what they share.

Layout, by role: ``config`` (the kinds' configuration section, and which tier class serves each
kind), ``store`` (the store directory: checks, manifest settling, locks), ``manifest``,
``format`` (the block format), ``blockio`` (block reads and writes, with the one O_DIRECT
fallback), ``mover`` (the I/O threads), ``base`` (:class:`~kvtier.tiers.disk.base.DiskTier`,
what both media share), ``lmdb`` and ``files`` (the media).

:func:`open_store` opens a disk tier from its section; :func:`check_store` verifies a store
directory knowing nothing but its path (what ``kvtier check PATH`` runs). Nothing heavy is
imported here, so parsing a configuration does not load LMDB.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tiers.base import CheckReport
from kvtier.tiers.disk.config import DISK_MEDIA, DiskTierConfig

if TYPE_CHECKING:
    from kvtier.tiers.disk.base import DiskTier

__all__ = ["check_store", "get_store_class", "open_store", "registered_stores"]


def registered_stores() -> tuple[str, ...]:
    """The disk-tier kinds kvtier ships."""
    return DISK_MEDIA.names()


def get_store_class(kind: str, *, field: str = "kind") -> type[DiskTier]:
    """The class of disk tiers of ``kind``; a ConfigError listing the kinds for anything else."""
    return DISK_MEDIA.resolve(kind, field=field)


def open_store(
    config: DiskTierConfig, rows: Any, fingerprint: Any, field: str = "tiers[1]", **options: Any
) -> DiskTier:
    """Open the disk tier ``config`` describes over CPU rows ``rows`` (see ``DiskTier.open``)."""
    return config.open_lower(rows, fingerprint, field=field, **options)


def check_store(path: str, fix: bool = False, secret_file: str | None = None) -> CheckReport:
    """Verify the store at ``path`` from its manifest alone; with ``fix``, drop what is bad.

    ``secret_file``: the tier's secret, to verify keyed blocks. Without it a keyed block is a
    problem (it cannot be verified), and ``fix`` is refused (ConfigError) when there are
    such blocks rather than dropping blocks that may be sound.

    Opens the store as one more user (safe while an engine uses it), reads every block, and
    closes it. Blocks the caller for a full read of the store. Without ``fix`` every file is
    opened read-only and nothing is created or written. Raises :class:`ConfigError` if
    ``path`` is not a kvtier store. A manifest naming a kind whose files the directory does
    not hold (or that holds another kind's files) is a problem found, and nothing is opened.
    """
    import numpy as np

    from kvtier.errors import ManifestError
    from kvtier.tiers.disk.blockio import aligned_buffer
    from kvtier.tiers.disk.format import padded_payload_bytes
    from kvtier.tiers.disk.manifest import MANIFEST_NAME, read_manifest
    from kvtier.tiers.disk.store import store_directory_path

    directory = store_directory_path(path, "path")
    loose: list[str] = []
    fixed: list[str] = []
    if os.path.isdir(directory) and os.path.lexists(os.path.join(directory, MANIFEST_NAME)):
        # who may reach the store comes first: nothing in it is read before that is known
        refused, loose, fixed = _access_problems(directory, fix)
        if refused:  # an engine would refuse to open it too: nothing is opened
            return CheckReport(directory, problems=refused)
    try:
        manifest = read_manifest(directory) if os.path.isdir(directory) else None
    except ManifestError as exc:
        raise ConfigError("path", path, "a kvtier store directory", str(exc)) from None
    if manifest is None:
        raise ConfigError(
            "path",
            path,
            f"a kvtier store directory (one holding {MANIFEST_NAME})",
            "give the path: of a disk tier from its configuration",
        )
    mismatch = _kind_mismatch(directory, manifest.kind)
    if mismatch is not None:
        return CheckReport(directory, problems=[mismatch])
    config = DiskTierConfig(
        name="check",
        kind=manifest.kind,
        capacity_bytes=manifest.capacity_bytes,
        path=directory,
        # read-only: the O_DIRECT probe would write a file
        o_direct="auto" if fix else "off",
        secret_file=secret_file,
        codec=manifest.fingerprint.codec,
    )
    # One CPU row of scratch, page-aligned and padded, as the tier's rows: check() reads into
    # its own buffers, and no job ever runs, but the tier is built over a real row layout.
    block_bytes = manifest.block_bytes
    scratch = aligned_buffer(padded_payload_bytes(block_bytes))
    rows = np.frombuffer(scratch, dtype=np.uint8)[:block_bytes].reshape(1, block_bytes)
    tier = open_store(
        config, rows, manifest.fingerprint, field="store", threads=1, access="fix" if fix else "check"
    )
    try:
        if fix and secret_file is None:
            found = tier.check()
            if any("keyed (no secret here)" in problem for problem in found.problems):
                raise ConfigError(
                    "secret_file",
                    None,
                    "the store's secret, to fix a store of keyed blocks",
                    "give --secret-file (the tier's secret_file); without it sound blocks would be dropped",
                )
        report = tier.check(fix=fix)
    finally:
        tier.close()
    report.tier = directory
    report.problems[:0] = loose
    report.fixed[:0] = fixed
    return report


def _kind_mismatch(directory: str, kind: str) -> str | None:
    """Why the files in ``directory`` are not those of a ``kind`` store, or None if they may be."""
    if kind not in DISK_MEDIA.names():
        return f"the manifest names kind {kind!r}, which is not a disk-tier kind ({', '.join(DISK_MEDIA.names())})"
    own = set(DISK_MEDIA.resolve(kind, field="kind").medium_names)
    for other in DISK_MEDIA.names():
        if other == kind:
            continue
        theirs = [
            name
            for name in DISK_MEDIA.resolve(other, field="kind").medium_names
            if name not in own and os.path.lexists(os.path.join(directory, name))
        ]
        if theirs:
            return (
                f"the manifest names a {kind} store, but the directory holds the files of a {other} "
                f"store ({', '.join(theirs)}); nothing was opened or written. Fix: if the store is "
                f"disposable, remove {directory} and let kvtier recreate it"
            )
    return None


def _access_problems(directory: str, fix: bool) -> tuple[list[str], list[str], list[str]]:
    """What stands between the store and other users: ``(problems that stop the check,
    other problems, what fix did)``.

    Stopping (an engine refuses such a store too): a directory another user owns or may
    write, entries of other users, symlinks, FIFOs and other non-regular files, directories
    others may write (found with lstat alone: nothing is opened, so nothing can hang). Not
    stopping: a store directory others may read (made 0700 by ``fix``, as any open does).
    """
    import stat

    from kvtier.tiers.disk.store import DIR_MODE, directory_problem

    info = os.stat(directory)
    problem = directory_problem(info, directory)
    if problem is not None:
        return [f"{problem[0]}. Fix: {problem[1]}"], [], []
    refused: list[str] = []
    loose: list[str] = []
    fixed: list[str] = []
    me = os.geteuid()
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            entry = os.lstat(path)
            if entry.st_uid != me:
                refused.append(
                    f"{path} belongs to uid {entry.st_uid}, not this user (uid {me}): another user planted it"
                )
            elif stat.S_ISLNK(entry.st_mode):
                refused.append(f"{path} is a symlink: kvtier never follows one inside a store")
            elif stat.S_ISDIR(entry.st_mode):
                if entry.st_mode & 0o022:
                    refused.append(
                        f"{path} is writable by group or others (mode {stat.S_IMODE(entry.st_mode):o})"
                    )
            elif not stat.S_ISREG(entry.st_mode):
                refused.append(f"{path} is not a regular file (a FIFO, socket or device)")
    if refused:
        refused[-1] += (
            f". Fix: remove what you did not create, or remove {directory} and let kvtier recreate it"
        )
        return refused, [], []
    mode = stat.S_IMODE(info.st_mode)
    if mode != DIR_MODE:
        loose.append(
            f"{directory} has mode {mode:o}: other users may reach the KV blocks in it "
            f"(`kvtier check --fix`, or any open by an engine, sets {DIR_MODE:o})"
        )
        if fix:
            os.chmod(directory, DIR_MODE)
            fixed.append(f"set the mode of {directory} to {DIR_MODE:o} (it was {mode:o})")
    return refused, loose, fixed

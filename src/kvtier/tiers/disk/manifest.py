"""The manifest every disk-tier directory carries: which kind of store, for which layout.

``kvtier-store.json`` is written once, atomically (temp file, fsync, rename, fsync of the
directory), when a store is created, and rewritten the same way when its capacity changes. It
is what makes ``kvtier check PATH`` need nothing but the path, and what an opener compares its
own layout fingerprint with before serving anything.

Who calls it: the disk tiers' ``open`` and ``kvtier check``; blocking file I/O, never on a
scheduler hot path.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass

from kvtier.atomic import replace_file
from kvtier.errors import ManifestError
from kvtier.tiers.disk.format import FORMAT_VERSION, READ_VERSIONS, LayoutFingerprint

__all__ = [
    "MANIFEST_NAME",
    "ManifestError",
    "StoreManifest",
    "fsync_directory",
    "read_manifest",
    "write_manifest",
]

# ManifestError is defined with every other error in kvtier.errors; named here too because
# readers of a manifest catch it.

#: file name of the manifest inside a store directory
MANIFEST_NAME = "kvtier-store.json"
_MANIFEST_MARK = "kvtier_store"


@dataclass(frozen=True)
class StoreManifest:
    """What a store directory holds."""

    #: the tier kind that wrote it (``lmdb`` or ``files``)
    kind: str
    #: block format version of its blocks
    format_version: int
    #: the layout its blocks belong to
    fingerprint: LayoutFingerprint
    #: the capacity it was last opened with, in bytes
    capacity_bytes: int
    #: when the store was created (seconds since the epoch)
    created_s: float
    #: the 16-bit id of the secret its blocks are keyed with (0: unkeyed, or not recorded)
    key_id: int = 0

    @property
    def block_bytes(self) -> int:
        return self.fingerprint.block_bytes

    def to_dict(self) -> dict:
        return {
            _MANIFEST_MARK: 1,
            "kind": self.kind,
            "format_version": self.format_version,
            "fingerprint": {**self.fingerprint.to_dict(), "digest": self.fingerprint.digest().hex()},
            "block_bytes": self.block_bytes,
            "capacity_bytes": self.capacity_bytes,
            "created_s": self.created_s,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_s)),
            **({"key_id": self.key_id} if self.key_id else {}),
        }

    @classmethod
    def new(
        cls, kind: str, fingerprint: LayoutFingerprint, capacity_bytes: int, key_id: int = 0
    ) -> StoreManifest:
        # blocks without a codec are still written as version 2: an older kvtier reads the store
        version = FORMAT_VERSION if fingerprint.codec != "none" else 2
        return cls(kind, version, fingerprint, capacity_bytes, time.time(), key_id)


def read_manifest(directory: str) -> StoreManifest | None:
    """The manifest of the store in ``directory``; ``None`` if it has none.

    Raises :class:`ManifestError` (naming the file and the fix) when the file exists but is
    damaged or was written by a format this kvtier does not read.
    """
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        # never through a symlink, and never a FIFO (O_NONBLOCK: its open would wait for a writer)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, encoding="utf-8") as stream:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.ENXIO, "not a regular file")
            record = json.load(stream)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(
            f"{path}: cannot read the store manifest ({exc}); if the store is disposable, "
            f"remove {directory} and let kvtier recreate it"
        ) from exc
    try:
        if record.get(_MANIFEST_MARK) != 1:
            raise ValueError(f"no '{_MANIFEST_MARK}: 1' mark")
        fingerprint = LayoutFingerprint.from_dict(record["fingerprint"])
        manifest = StoreManifest(
            kind=str(record["kind"]),
            format_version=int(record["format_version"]),
            fingerprint=fingerprint,
            capacity_bytes=int(record["capacity_bytes"]),
            created_s=float(record.get("created_s", 0.0)),
            key_id=int(record.get("key_id", 0)),
        )
        digest = record["fingerprint"].get("digest")
        if digest is not None and digest != fingerprint.digest().hex():
            raise ValueError("the fingerprint digest does not match its fields")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ManifestError(
            f"{path}: not a valid kvtier store manifest ({exc}); if the store is disposable, "
            f"remove {directory} and let kvtier recreate it"
        ) from exc
    if manifest.format_version not in READ_VERSIONS:
        raise ManifestError(
            f"{path}: store format version {manifest.format_version}, but this kvtier reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}; use the kvtier that wrote it, or "
            f"remove {directory}"
        )
    return manifest


def write_manifest(directory: str, manifest: StoreManifest) -> None:
    """Write ``manifest`` into ``directory`` atomically and durably (raises ``OSError``)."""
    text = json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n"
    replace_file(os.path.join(directory, MANIFEST_NAME), text.encode(), durable=True)
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

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


def check_store(path: str, fix: bool = False) -> CheckReport:
    """Verify the store at ``path`` from its manifest alone; with ``fix``, drop what is bad.

    Opens the store as one more user (safe while an engine uses it), reads every block, and
    closes it. Blocks the caller for a full read of the store. Raises :class:`ConfigError`
    if ``path`` is not a kvtier store.
    """
    import numpy as np

    from kvtier.errors import ManifestError
    from kvtier.tiers.disk.blockio import aligned_buffer
    from kvtier.tiers.disk.format import padded_payload_bytes
    from kvtier.tiers.disk.manifest import MANIFEST_NAME, read_manifest

    directory = os.path.abspath(path)
    try:
        manifest = read_manifest(directory) if os.path.isdir(directory) else None
    except ManifestError as exc:
        raise ConfigError("path", path, "a kvtier store directory", str(exc)) from None
    if manifest is None:
        raise ConfigError(
            "path", path, f"a kvtier store directory (one holding {MANIFEST_NAME})",
            "give the path: of a disk tier from its configuration",
        )
    config = DiskTierConfig(
        name="check", kind=manifest.kind, capacity_bytes=manifest.capacity_bytes, path=directory,
    )
    # One CPU row of scratch, page-aligned and padded, as the tier's rows: check() reads into
    # its own buffers, and no job ever runs, but the tier is built over a real row layout.
    block_bytes = manifest.block_bytes
    scratch = aligned_buffer(padded_payload_bytes(block_bytes))
    rows = np.frombuffer(scratch, dtype=np.uint8)[:block_bytes].reshape(1, block_bytes)
    tier = open_store(config, rows, manifest.fingerprint, field="store", threads=1)
    try:
        report = tier.check(fix=fix)
    finally:
        tier.close()
    report.tier = directory
    return report

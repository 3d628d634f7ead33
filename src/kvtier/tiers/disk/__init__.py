"""Secondary tiers: what lies below the CPU tier (disk tiers, and test doubles).

Disk tiers are chosen by the ``kind`` of their configuration section: :func:`get_store_class`
maps the kind to a lazily imported class (importing ``lmdb`` costs nothing until a tier of
that kind is used), and :func:`open_store` opens one. :func:`check_store` verifies a store
directory knowing nothing but its path (what ``kvtier check PATH`` runs).
"""

from __future__ import annotations

import importlib
import os

import numpy as np

from kvtier.config import DiskTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import CheckReport, SecondaryTier
from kvtier.tiers.disk.format import padded_payload_bytes
from kvtier.tiers.disk.manifest import MANIFEST_NAME, ManifestError, read_manifest
from kvtier.tiers.disk.mover import aligned_buffer

__all__ = ["check_store", "get_store_class", "open_store", "registered_stores"]

_REGISTRY: dict[str, str] = {
    "lmdb": "kvtier.tiers.disk.lmdb:LMDBTier",
    "files": "kvtier.tiers.disk.files:FilesTier",
}


def registered_stores() -> tuple[str, ...]:
    """The disk-tier kinds kvtier ships."""
    return tuple(_REGISTRY)


def get_store_class(kind: str, *, field: str = "kind") -> type[SecondaryTier]:
    """The class of disk tiers of ``kind``; a ConfigError listing the kinds for anything else."""
    target = _REGISTRY.get(kind)
    if target is None:
        raise ConfigError(
            field, kind, "a disk-tier kind: " + ", ".join(_REGISTRY),
            "use kind: lmdb (LMDB index over a slab) or kind: files (one file per block)",
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def open_store(config: DiskTierConfig, rows, fingerprint, field: str = "tiers[1]", **options) -> SecondaryTier:
    """Open the disk tier ``config`` describes over CPU rows ``rows`` (blocks; see ``DiskTier.open``)."""
    cls = get_store_class(config.kind, field=f"{field}.kind")
    return cls.open(config, rows, fingerprint, field=field, **options)


def check_store(path: str, fix: bool = False) -> CheckReport:
    """Verify the store at ``path`` from its manifest alone; with ``fix``, drop what is bad.

    Opens the store as one more user (safe while an engine uses it), reads every block, and
    closes it. Blocks the caller for a full read of the store. Raises :class:`ConfigError`
    if ``path`` is not a kvtier store.
    """
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

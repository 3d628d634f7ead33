"""The disk kinds' configuration section (``lmdb``, ``files``): a store directory on local disk.

Only this module names the section's own keys (``path``, ``o_direct``, ``fsync``, ``threads``,
the admission keys) and their
defaults and errors; the common keys are :class:`kvtier.config.TierConfig`'s. Both kinds share
the section; :data:`DISK_MEDIA` says which tier class serves each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config.checks import MISSING, non_empty_str, parse_choice
from kvtier.config.schema import TierConfig
from kvtier.config.units import positive_int
from kvtier.errors import ConfigError
from kvtier.policies.admission import ADMIT_MODES
from kvtier.registry import Registry
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.disk.mover import DEFAULT_THREADS
from kvtier.tiers.secret import parse_secret_options

if TYPE_CHECKING:
    from kvtier.tiers.disk.base import DiskTier

__all__ = [
    "DISK_MEDIA",
    "FSYNC_CHOICES",
    "O_DIRECT_CHOICES",
    "DiskTierConfig",
    "default_store_path",
    "user_cache_root",
]

#: ``o_direct`` values: auto (probe once, fall back logged and counted), on (fail at open if
#: unsupported), off
O_DIRECT_CHOICES = ("auto", "on", "off")
#: ``fsync`` values: none (leave it to the OS), batch (once per job), always (each block)
FSYNC_CHOICES = ("none", "batch", "always")
#: more I/O threads than this only queue in the kernel (an NVMe drive saturates with 16-64)
MAX_THREADS = 256


def user_cache_root() -> str:
    """Where this user's stores go by default: ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``
    (the per-user cache directory of the XDG base-directory convention)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the convention ignores a relative value
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def default_store_path(name: str) -> str:
    """The per-user path a tier named ``name`` is suggested to use."""
    return os.path.join(user_cache_root(), name)


@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """A disk tier (``lmdb`` or ``files``) in the directory ``path``."""

    # the store directory, created if its parent exists (required)
    path: str | None = None
    # O_DIRECT for block I/O: auto (probe once, fall back with a logged, counted warning),
    # on (fail at open if unsupported), off
    o_direct: str = "auto"
    # when to fsync: none (leave it to the OS), batch (once per batch of blocks), always
    # (each block)
    fsync: str = "batch"
    # I/O threads moving this tier's blocks (each job's blocks are spread over them)
    threads: int = DEFAULT_THREADS
    # which blocks are written here: all, or reuse (only once offered or looked up
    # min_reuse times, so one-off blocks never wear the drive)
    admit: str = "all"
    # with admit: reuse, the sightings a block needs before it is written here
    min_reuse: int = 2
    # the drive's rated endurance in terabytes written; stats project its life from it
    endurance_tbw: float | None = None
    # the longest an open waits for the store's maintenance lock (held by another process of
    # this user while it opens the store) before failing with an error naming the lock
    lock_timeout_s: float = 60.0
    # a file of >= 32 random bytes (mode 0600, this user's): blocks carry a keyed MAC and
    # blocks written without it (or under another) are misses; None: xxh3 checksums only
    secret_file: str | None = None
    # none, or aes-gcm: blocks are encrypted at rest under secret_file
    encrypt: str = "none"

    @classmethod
    def parse_options(cls, section: Mapping[str, object], field: str, name: str) -> dict[str, object]:
        # a disk tier has nowhere to go without a directory
        path = section.get("path", MISSING)
        options: dict[str, object] = {
            "path": non_empty_str(
                path,
                f"{field}.path",
                "a non-empty path string (a directory)",
                f"add path: such as {default_store_path(name)} (a directory of your own; "
                f"not a directory every user may write, such as /tmp or /var/tmp)"
                if path is MISSING
                else "write the path as a string",
            )
        }
        if "o_direct" in section:
            options["o_direct"] = parse_choice(
                section["o_direct"], f"{field}.o_direct", O_DIRECT_CHOICES, bools=True
            )
        if "fsync" in section:
            options["fsync"] = parse_choice(section["fsync"], f"{field}.fsync", FSYNC_CHOICES)
        if "threads" in section:
            threads = positive_int(section["threads"], f"{field}.threads")
            if threads > MAX_THREADS:
                raise ConfigError(
                    f"{field}.threads",
                    threads,
                    f"at most {MAX_THREADS} I/O threads",
                    f"{DEFAULT_THREADS} (the default) saturates a local NVMe drive",
                )
            options["threads"] = threads
        if "admit" in section:
            options["admit"] = parse_choice(section["admit"], f"{field}.admit", ADMIT_MODES)
        if "min_reuse" in section:
            options["min_reuse"] = positive_int(section["min_reuse"], f"{field}.min_reuse")
        if "endurance_tbw" in section:
            tbw = section["endurance_tbw"]
            if isinstance(tbw, bool) or not isinstance(tbw, (int, float)) or not tbw > 0:
                raise ConfigError(
                    f"{field}.endurance_tbw",
                    tbw,
                    "a positive number of terabytes written",
                    "write the drive's rated endurance, such as 600",
                )
            options["endurance_tbw"] = float(tbw)
        if "lock_timeout_s" in section:
            timeout = section["lock_timeout_s"]
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
                raise ConfigError(
                    f"{field}.lock_timeout_s",
                    timeout,
                    "a number of seconds above 0 (at most 86400)",
                    "such as 60 (the default)",
                )
            options["lock_timeout_s"] = float(timeout)
        options.update(parse_secret_options(section, field))
        return options

    def location(self) -> str | None:
        return self.path

    def admission(self) -> tuple[str, int, float | None]:
        return self.admit, self.min_reuse, self.endurance_tbw

    def open_lower(self, rows: Any, fingerprint: Any, *, field: str, **options: Any) -> DiskTier:
        """Open the store at ``path`` (see :meth:`kvtier.tiers.disk.base.DiskTier.open`;
        ``options``: ``threads``, to override the section's I/O threads)."""
        cls = DISK_MEDIA.resolve(self.kind, field=f"{field}.kind")
        return cls.open(self, rows, fingerprint, field=field, **options)


#: disk kind -> the tier class serving it ("module:Class", imported when a tier opens)
DISK_MEDIA: Registry[DiskTier] = Registry(  # classes with DiskTier's open()
    "disk-tier kind",
    SecondaryTier,
    {"lmdb": "kvtier.tiers.disk.lmdb:LMDBTier", "files": "kvtier.tiers.disk.files:FilesTier"},
    module_key="module_path",
)

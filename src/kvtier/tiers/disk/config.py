"""The disk kinds' configuration section (``lmdb``, ``files``): a store directory on local disk.

Only this module names the section's own keys (``path``, ``o_direct``, ``fsync``, ``threads``,
the admission keys) and their
defaults and errors; the common keys are :class:`kvtier.config.TierConfig`'s. Both kinds share
the section; :data:`DISK_MEDIA` says which tier class serves each.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvtier.config.checks import MISSING, non_empty_str, parse_choice
from kvtier.config.schema import TierConfig
from kvtier.config.units import format_size, positive_int, positive_size
from kvtier.errors import ConfigError
from kvtier.policies.admission import ADMIT_MODES, check_min_reuse
from kvtier.policies.write_budget import SECONDS_PER_YEAR, WriteBudget
from kvtier.registry import Registry
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.disk.mover import DEFAULT_THREADS
from kvtier.codecs import parse_codec_option
from kvtier.tiers.secret import parse_secret_options

if TYPE_CHECKING:
    from kvtier.tiers.disk.base import DiskTier

__all__ = [
    "BUDGET_KEYS",
    "DISK_MEDIA",
    "FSYNC_CHOICES",
    "O_DIRECT_CHOICES",
    "DiskTierConfig",
    "budget_figures",
    "default_store_path",
    "free_bytes",
    "room_problem",
    "stored_bytes",
    "user_cache_root",
]

logger = logging.getLogger(__name__)

#: ``o_direct`` values: auto (probe once, fall back logged and counted), on (fail at open if
#: unsupported), off
O_DIRECT_CHOICES = ("auto", "on", "off")
#: ``fsync`` values: none (leave it to the OS), batch (once per job), always (each block)
FSYNC_CHOICES = ("none", "batch", "always")
#: more I/O threads than this only queue in the kernel (an NVMe drive saturates with 16-64)
MAX_THREADS = 256


def free_bytes(path: str) -> int:
    """Bytes this user may still write on the filesystem holding ``path``."""
    found = os.statvfs(path)
    return found.f_bavail * found.f_frsize


def room_problem(path: str, needed_bytes: int) -> str | None:
    """Why ``needed_bytes`` more do not fit on the filesystem holding ``path``, or None."""
    free = free_bytes(path)
    if needed_bytes <= free:
        return None
    return f"{format_size(needed_bytes)} more needed, {format_size(free)} free there"


def stored_bytes(path: str) -> int:
    """Bytes the files under ``path`` take on disk now (0: no such directory)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


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
    # which blocks are written here: all, reuse (only once offered or looked up
    # min_reuse times, so one-off blocks never wear the drive), or budget (the reuse a block
    # needs adapts so the drive's writes stay within drive_writes_per_day, or within
    # endurance_tbw spread over target_life_years)
    admit: str = "all"
    # with admit: reuse, the sightings a block needs before it is written here, from 1 to 255;
    # fractional allowed: 1.8 writes every block seen twice and, 20% of the time, those seen once
    min_reuse: float = 2
    # the drive's rated endurance in terabytes written; stats project its life from it
    endurance_tbw: float | None = None
    # admit: budget: the drive's full writes per day the tier may make (DWPD, of drive_bytes)
    drive_writes_per_day: float | None = None
    # admit: budget: the drive's size for drive_writes_per_day; None: the size of the
    # filesystem holding path
    drive_bytes: int | None = None
    # admit: budget: the years the drive should last; with endurance_tbw the budget is its
    # endurance spread over them; with drive_writes_per_day (default 5, a usual warranty) it
    # only sets the endurance stats project life from, when endurance_tbw is not given
    target_life_years: float | None = None
    # admit: budget: seconds of budget the tier may bank and spend at once (the token
    # bucket's size); also the span the write rate in stats is averaged over
    budget_window_s: float = 3600.0
    # the longest an open waits for the store's maintenance lock (held by another process of
    # this user while it opens the store) before failing with an error naming the lock
    lock_timeout_s: float = 60.0
    # a file of >= 32 random bytes (mode 0600, this user's): blocks carry a keyed MAC and
    # blocks written without it (or under another) are misses; None: xxh3 checksums only
    secret_file: str | None = None
    # none, or aes-gcm: blocks are encrypted at rest under secret_file
    encrypt: str = "none"
    # how blocks are stored: none (as they are), lossless (byte planes + zstd), or, lossy
    # and opt-in, int8, fp8, int4 (need the KV's element dtype); see docs/tiers/codecs.md
    codec: str = "none"

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
            options["min_reuse"] = check_min_reuse(section["min_reuse"], f"{field}.min_reuse")
        if "endurance_tbw" in section:
            options["endurance_tbw"] = _positive_number(
                section["endurance_tbw"],
                f"{field}.endurance_tbw",
                "a positive number of terabytes written",
                "write the drive's rated endurance, such as 600",
            )
        options.update(_budget_options(section, field, options.get("admit", "all")))
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
        options.update(parse_codec_option(section, field))
        return options

    def location(self) -> str | None:
        return self.path

    def blocks_held(self, block_bytes: int) -> int | None:
        from kvtier.tiers.disk.format import on_disk_block_bytes  # a block's header and padding

        return self.capacity_bytes // on_disk_block_bytes(block_bytes)

    def host_problems(self, field: str) -> list[ConfigError]:
        """The capacity against the room on the disk: what the store holds there already
        plus the free space (payload bytes; each block also takes a 4 KiB header page)."""
        assert self.path is not None
        path = os.path.abspath(os.path.expanduser(self.path))  # as the store opens it
        where = path
        while not os.path.isdir(where):  # a store not created yet: the disk of its parent
            where = os.path.dirname(where)
        problem = room_problem(where, self.capacity_bytes - stored_bytes(path))
        if problem is None:
            return []
        return [
            ConfigError(
                f"{field}.capacity",
                format_size(self.capacity_bytes),
                f"at most what fits in {path}: {problem}",
                "lower the capacity, free space there, or choose another disk (the tier opens all "
                "the same, and fails the stores that find the disk full, counted)",
            )
        ]

    def admission(self) -> tuple[str, float, float | None]:
        return self.admit, self.min_reuse, self.endurance_tbw

    def unused_keys(self) -> tuple[str, ...]:
        """``min_reuse`` but under ``admit: reuse`` (a budget sets its own bar), the budget's
        keys but under ``admit: budget``, ``encrypt`` without a secret."""
        unused = [] if self.admit == "reuse" else ["min_reuse"]
        if self.admit != "budget":
            unused += BUDGET_KEYS
        if self.secret_file is None:
            unused.append("encrypt")
        return tuple(unused)

    def write_budget(self, field: str) -> WriteBudget | None:
        """With ``admit: budget``, the tier's :class:`WriteBudget`, counting the writes of the
        drive under ``path`` where ``/sys`` shows them (call once the store is open: the
        drive's size may come from its filesystem). ConfigError if the figures disagree."""
        if self.admit != "budget":
            return None
        from kvtier.tiers.disk.wear import DeviceWriteCounter, filesystem_bytes

        assert self.path is not None
        drive = self.drive_bytes or filesystem_bytes(self.path)
        budget, endurance = budget_figures(
            self.drive_writes_per_day, self.target_life_years, self.endurance_tbw, drive, field
        )
        counter = DeviceWriteCounter.for_path(self.path)
        logger.info(
            "kvtier: tier %s writes at most %s/s (%s); counting %s",
            self.name,
            format_size(int(budget)),
            f"{self.drive_writes_per_day} drive writes a day of {format_size(drive)}"
            if self.drive_writes_per_day is not None
            else f"{self.endurance_tbw} TBW over {self.target_life_years} years",
            f"the writes of /sys/block/{counter.device}" if counter else "the tier's own writes",
        )
        return WriteBudget(
            budget,
            self.budget_window_s,
            endurance,
            device_written=counter.written_bytes if counter is not None else None,
        )

    def open_lower(self, rows: Any, fingerprint: Any, *, field: str, **options: Any) -> DiskTier:
        """Open the store at ``path`` (see :meth:`kvtier.tiers.disk.base.DiskTier.open`;
        ``options``: ``threads``, to override the section's I/O threads)."""
        cls = DISK_MEDIA.resolve(self.kind, field=f"{field}.kind")
        return cls.open(self, rows, fingerprint, field=field, **options)


#: the keys that only ``admit: budget`` reads
BUDGET_KEYS = ("drive_writes_per_day", "drive_bytes", "target_life_years", "budget_window_s")
#: the drive life a ``drive_writes_per_day`` rating is taken over when no other is given (years)
DEFAULT_LIFE_YEARS = 5.0
#: how far apart the budget of drive_writes_per_day and that of endurance_tbw over
#: target_life_years may be before the config is refused as contradicting itself
_AGREEMENT = 1.01


def _positive_number(value: object, field: str, expected: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(field, value, expected, fix)
    return float(value)


def _budget_options(section: Mapping[str, object], field: str, admit: object) -> dict[str, object]:
    """The ``admit: budget`` keys of ``section``, checked alone and together."""
    given = [key for key in BUDGET_KEYS if key in section]
    if admit != "budget":
        if given:
            raise ConfigError(
                f"{field}.{given[0]}",
                section[given[0]],
                "a key read only with admit: budget",
                f"add admit: budget to hold the tier to a write budget, or remove {given[0]}",
            )
        return {}
    options: dict[str, object] = {}
    if "drive_writes_per_day" in section:
        options["drive_writes_per_day"] = _positive_number(
            section["drive_writes_per_day"],
            f"{field}.drive_writes_per_day",
            "a positive number of full drive writes per day",
            "write the share of the drive's rating the cache may use, such as 0.5",
        )
    if "drive_bytes" in section:
        options["drive_bytes"] = positive_size(section["drive_bytes"], f"{field}.drive_bytes")
    if "target_life_years" in section:
        options["target_life_years"] = _positive_number(
            section["target_life_years"],
            f"{field}.target_life_years",
            "a positive number of years",
            "write how long the drive should last, such as 5",
        )
    if "budget_window_s" in section:
        options["budget_window_s"] = _positive_number(
            section["budget_window_s"],
            f"{field}.budget_window_s",
            "a positive number of seconds",
            "such as 3600 (the default): an hour's budget may be spent at once",
        )
    tbw = section.get("endurance_tbw")
    life = options.get("target_life_years")
    if "drive_writes_per_day" not in options:
        if life is None or tbw is None:
            missing = "target_life_years" if tbw is not None else "endurance_tbw"
            raise ConfigError(
                f"{field}.admit",
                "budget",
                "drive_writes_per_day, or target_life_years with endurance_tbw, to size the budget"
                + ("" if life is None and tbw is None else f" (no {missing})"),
                "add drive_writes_per_day: 1 (one full drive write a day), or target_life_years: 5 "
                "with endurance_tbw: the drive's rated terabytes written",
            )
    elif "drive_bytes" in options and life is not None and tbw is not None:
        # all the figures are here: a contradiction is found now, not when the tier opens
        budget_figures(
            cast(float, options["drive_writes_per_day"]),
            cast(float, life),
            float(cast(float, tbw)),
            cast(int, options["drive_bytes"]),
            field,
        )
    return options


def budget_figures(
    dwpd: float | None, life: float | None, endurance_tbw: float | None, drive_bytes: int, field: str
) -> tuple[float, float]:
    """``(bytes per second the tier may write, the drive's endurance in bytes)`` of an
    ``admit: budget`` section (its ``drive_writes_per_day``, ``target_life_years``,
    ``endurance_tbw``) on a drive of ``drive_bytes``; ConfigError where drive_writes_per_day
    over target_life_years would write more than endurance_tbw."""
    tbw = None if endurance_tbw is None else endurance_tbw * 1e12
    if dwpd is None:
        assert life is not None and tbw is not None  # parse_options saw to it
        return tbw / (life * SECONDS_PER_YEAR), tbw
    budget = dwpd * drive_bytes / 86400
    if tbw is None:
        return budget, budget * (life or DEFAULT_LIFE_YEARS) * SECONDS_PER_YEAR
    if life is not None and budget * life * SECONDS_PER_YEAR > tbw * _AGREEMENT:
        most = tbw / (life * SECONDS_PER_YEAR) * 86400 / drive_bytes
        raise ConfigError(
            f"{field}.drive_writes_per_day",
            dwpd,
            f"at most {most:.3g}: {dwpd:g} writes a day of {format_size(drive_bytes)} wear out "
            f"endurance_tbw {endurance_tbw:g} in "
            f"{tbw / (budget * SECONDS_PER_YEAR):.2g} years, before target_life_years {life:g}",
            f"lower drive_writes_per_day to {most:.3g}, or drop target_life_years or "
            "drive_writes_per_day (either sizes the budget alone)",
        )
    return budget, tbw


#: disk kind -> the tier class serving it ("module:Class", imported when a tier opens)
DISK_MEDIA: Registry[DiskTier] = Registry(  # classes with DiskTier's open()
    "disk-tier kind",
    SecondaryTier,
    {"lmdb": "kvtier.tiers.disk.lmdb:LMDBTier", "files": "kvtier.tiers.disk.files:FilesTier"},
    module_key="module_path",
)

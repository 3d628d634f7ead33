"""The configuration's shape: frozen dataclasses that every tier kind, the parser and the stack share.

It names no kind: each kind's section subclasses :class:`TierConfig` beside its tier
(``kvtier/tiers/<kind>/config.py``) and is found through :data:`kvtier.config.kinds.TIER_KINDS`.
Units are in the field names (``capacity_bytes``); defaults live here and in the kinds' sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvtier.config.units import MiB, format_size
from kvtier.errors import ConfigError

__all__ = [
    "RECEIVES",
    "WRITE_POLICIES",
    "CascadeConfig",
    "KvtierConfig",
    "MetricsConfig",
    "MissCausesConfig",
    "TierConfig",
]

WRITE_POLICIES = ("write_back", "write_through")
#: how a tier below the first receives blocks (TierConfig.receives)
RECEIVES = ("saved", "evicted")


@dataclass(frozen=True)
class TierConfig:
    """What every tier has, whatever its kind; the base of every kind's own section.

    A tier kind is a subclass (a frozen dataclass adding the kind's own fields, each with its
    default) registered in :data:`~kvtier.config.TIER_KINDS`, or named by class path in ``kind``. The parser
    handles the common keys below and hands the rest of the section to the kind's
    :meth:`parse_options`; building the tier is the kind's :meth:`open_lower` (tiers below the
    first) or its own hook for the first tier. Nothing outside the kind's module names its
    fields, so a new kind is one new file.
    """

    # unique name of the tier in the stack; shows in stats, events and errors
    name: str
    # which implementation: a name registered in TIER_KINDS, or a class path module:Class
    kind: str
    # the tier never holds more payload than this many bytes
    capacity_bytes: int
    # eviction policy: a registered name (lru, arc, s3fifo, sieve, chain) or a class name in
    # eviction_module_path
    eviction: str = "lru"
    # module to import an out-of-tree eviction policy class from (None: built-in names only)
    eviction_module_path: str | None = None
    # module to import the kind's section class from when ``kind`` is a bare class name
    # (None: a registered kind, or a class path in ``kind``)
    module_path: str | None = None
    # tiers below the first only: "saved" (a mirror) takes every block saved out of the CPU
    # tier, when cascade.write_policy says; "evicted" (a victim tier) takes only blocks the
    # CPU tier lets go that no saved tier above it keeps. See TierStackManager.
    receives: str = "saved"

    #: True: a server bounds and evicts the tier's blocks (a shared store's own memory
    #: limit), so the section takes no capacity or eviction and capacity_bytes is 0
    bounded_by_server: ClassVar[bool] = False

    #: "first": the tier every GPU load comes from (exactly one, heading the stack);
    #: "lower": a tier below it, built with :meth:`open_lower`
    role: ClassVar[str] = "lower"

    @classmethod
    def parse_options(cls, section: Mapping[str, object], field: str, name: str) -> dict[str, object]:
        """The kind's own fields from its YAML ``section`` (common keys already parsed).

        ``field`` is the section's path (``tiers[1]``) for error messages, ``name`` the tier's
        name (for suggested values). Returns keyword arguments for the section class; a field
        left out takes its dataclass default. Raise :class:`ConfigError` naming
        ``<field>.<key>`` for a bad value, with what would be valid and the fix. Unknown keys
        never reach here: the parser refuses keys that are not fields of the class.
        """
        return {}

    def location(self) -> str | None:
        """Where the tier keeps its bytes (a path, a URL), for ``describe`` and logs; None: nowhere named."""
        return None

    def options_text(self) -> str:
        """The kind's own settings as ``key=value`` pairs, for ``describe``: sizes in units,
        and none that is unset (None), shown by :meth:`location`, or of no effect here
        (:meth:`unused_keys`)."""
        skipped = {f.name for f in fields(TierConfig)} | set(self.unused_keys())
        where = self.location()
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in skipped or value is None or (where is not None and value == where):
                continue
            if f.name.endswith("_bytes") and isinstance(value, int):
                value = format_size(value)
            shown.append(f"{f.name}={value}")
        return "  ".join(shown)

    def unused_keys(self) -> tuple[str, ...]:
        """The kind's keys that do nothing as the section is set (a disk tier's ``min_reuse``
        without ``admit: reuse``), left out of ``describe``. Default: none."""
        return ()

    def admission(self) -> tuple[str, float, float | None]:
        """Which blocks a lower tier takes: ``(admit, min_reuse, endurance_tbw)``, see
        :class:`~kvtier.policies.admission.AdmissionFilter`. Default: every block, no
        endurance figure; a kind with such settings (the disk kinds) returns its own."""
        return "all", 1, None

    def write_budget(self, field: str) -> Any:
        """With ``admit: budget``, the tier's :class:`~kvtier.policies.write_budget.WriteBudget`
        (called once the tier is open; ``field`` names the section for errors). Default: None,
        no budget; a kind that takes ``admit: budget`` (the disk kinds) builds its own."""
        return None

    def blocks_held(self, block_bytes: int) -> int | None:
        """About how many blocks of ``block_bytes`` payload the tier holds at its capacity
        (what a stack sizes its miss-cause sketch from); None where a server bounds it. The
        default counts payload only; a kind that adds per-block bytes says so."""
        return None if self.bounded_by_server else self.capacity_bytes // block_bytes

    def host_problems(self, field: str) -> list[ConfigError]:
        """What this machine lacks for the tier as configured (``field`` names it:
        ``tiers[1]``), each an error naming the key and the fix: what ``kvtier config check``
        reports. Opening the tier is more lenient where it can serve anyway (a disk tier whose
        capacity exceeds the free space opens, and counts the stores that find the disk full).
        Default: nothing to check."""
        return []

    def open_first(self, block_bytes: int, *, field: str) -> Any:
        """Build the first tier (a :class:`~kvtier.base.Backend` with ``rows``, the CPU rows
        every lower tier copies from and into) holding blocks of ``block_bytes``; for kinds
        whose :attr:`role` is ``"first"``. Called once, by whoever builds the stack."""
        raise ConfigError(
            f"{field}.kind",
            self.kind,
            "a kind that can head the stack (cpu)",
            "put a cpu tier first",
        )

    def open_lower(self, rows: Any, fingerprint: Any, *, field: str, **options: Any) -> Any:
        """Open the tier this section describes below the first tier: a
        :class:`~kvtier.tiers.base.SecondaryTier` over the first tier's ``rows``.

        ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view jobs copy from and
        into; ``fingerprint`` (:class:`~kvtier.tiers.disk.format.LayoutFingerprint`) names the
        engine's KV layout; ``field`` is the section's path for errors; ``options`` are
        builder overrides a kind may accept (``threads`` for disk tiers). Called once, by
        whoever builds the stack; may block (opening files, connecting).
        """
        raise ConfigError(
            f"{field}.kind",
            self.kind,
            "a kind that can sit below the first tier",
            "use this kind as tiers[0] only",
        )


@dataclass(frozen=True)
class CascadeConfig:
    """How blocks move between tiers."""

    # write_back: demote the coldest CPU blocks ahead of need at on_schedule_end;
    # write_through: cascade every stored block down
    write_policy: str = "write_back"
    # bound of the bytes demoted (written to the next tier) per scheduler step
    max_demote_bytes_per_step: int = 512 * MiB
    # bound of the bytes promoted (read from a lower tier) per scheduler step
    max_promote_bytes_per_step: int = 512 * MiB


@dataclass(frozen=True)
class MetricsConfig:
    """Where a running stack reports its counters (``stats()``); both ways are off by default."""

    # port of a Prometheus endpoint serving stats() at http://addr:port/metrics (needs
    # prometheus_client, kvtier's prometheus extra); none: no endpoint; 0: any free port
    port: int | None = None
    # address the endpoint binds: loopback unless the counters are meant to leave the machine
    addr: str = "127.0.0.1"
    # path of a Unix socket serving the same endpoint, mode 0600 (this user alone may scrape
    # it, where any local user may reach a port); in a folder only this user may write
    unix_socket: str | None = None
    # a file rewritten with stats() as JSON every stats_interval_s (atomically, mode 0600),
    # for `kvtier stats PATH`: a new path or a previous stats file, in a folder only this user
    # may write; none: no file
    stats_file: str | None = None
    # seconds between two writes of stats_file (at most a day)
    stats_interval_s: float = 5.0


@dataclass(frozen=True)
class MissCausesConfig:
    """Counting each miss under its cause (new, evicted, refused, ...): how many keys the
    stack remembers to tell them apart (``miss_causes: off`` turns it off)."""

    # keys remembered (about 5.3 bytes each; beyond it the oldest are forgotten and their
    # misses read as new); none: sized from the stack, the CPU tier's blocks plus twice the
    # lower tiers' (4,096 to 4,194,304; the most with a tier a server bounds); 0: off, no
    # sketch and no miss_<cause> counters
    keys: int | None = None

    @property
    def enabled(self) -> bool:
        return self.keys != 0


@dataclass(frozen=True)
class KvtierConfig:
    """A whole kvtier setup: the ordered tier stack and how blocks move along it."""

    # ordered fastest first; tiers[0] is always the cpu tier (the gateway to the GPU)
    tiers: tuple[TierConfig, ...]
    # tokens an offloaded block spans (a multiple of the engine's GPU block size);
    # None: the same as the engine's block
    block_size_tokens: int | None = None
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    # a metrics endpoint and a stats file for a running stack (both off by default)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # miss causes and the bounded sketch behind them (docs/operations/miss-causes.md)
    miss_causes: MissCausesConfig = field(default_factory=MissCausesConfig)

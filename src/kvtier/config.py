"""Configuration: parsed once, at the edge, into frozen typed objects.

Nothing deeper in kvtier reads raw dicts: every tier, policy and manager is built from the
objects below. Units are in the field names (``capacity_bytes``); defaults live here only.
"""

from __future__ import annotations

import difflib
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation, localcontext
from typing import TYPE_CHECKING, Any, ClassVar

import yaml

from kvtier.errors import ConfigError, shown_value
from kvtier.policies import POLICIES
from kvtier.registry import Registry

if TYPE_CHECKING:  # reached lazily at run time (module __getattr__ below)
    from kvtier.tiers.cpu.config import CPUTierConfig
    from kvtier.tiers.disk.config import DiskTierConfig

__all__ = [
    "TIER_KINDS",
    "TierConfig",
    "CPUTierConfig",
    "DiskTierConfig",
    "CascadeConfig",
    "RECEIVES",
    "KvtierConfig",
    "load_config",
    "parse_size",
    "format_size",
    "describe",
    "parse_choice",
    "parse_tier",
    "positive_int",
    "positive_size",
    "non_empty_str",
    "MISSING",
]

MiB = 1 << 20

WRITE_POLICIES = ("write_back", "write_through")
#: how a tier below the first receives blocks (TierConfig.receives)
RECEIVES = ("saved", "evicted")


@dataclass(frozen=True)
class TierConfig:
    """What every tier has, whatever its kind; the base of every kind's own section.

    A tier kind is a subclass (a frozen dataclass adding the kind's own fields, each with its
    default) registered in :data:`TIER_KINDS`, or named by class path in ``kind``. The parser
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
        """The kind's own settings as ``key=value`` pairs, for ``describe`` (the field that
        :meth:`location` shows is left out)."""
        common = {f.name for f in fields(TierConfig)}
        where = self.location()
        return "  ".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in common and not (where is not None and getattr(self, f.name) == where)
        )

    def admission(self) -> tuple[str, int, float | None]:
        """Which blocks a lower tier takes: ``(admit, min_reuse, endurance_tbw)``, see
        :class:`~kvtier.policies.admission.AdmissionFilter`. Default: every block, no
        endurance figure; a kind with such settings (the disk kinds) returns its own."""
        return "all", 1, None

    def open_first(self, block_bytes: int, *, field: str) -> Any:
        """Build the first tier (a :class:`~kvtier.base.Backend` with ``rows``, the CPU rows
        every lower tier copies from and into) holding blocks of ``block_bytes``; for kinds
        whose :attr:`role` is ``"first"``. Called once, by whoever builds the stack."""
        raise ConfigError(
            f"{field}.kind", self.kind, "a kind that can head the stack (cpu)",
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
            f"{field}.kind", self.kind, "a kind that can sit below the first tier",
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
class KvtierConfig:
    """A whole kvtier setup: the ordered tier stack and how blocks move along it."""

    # ordered fastest first; tiers[0] is always the cpu tier (the gateway to the GPU)
    tiers: tuple[TierConfig, ...]
    # tokens an offloaded block spans (a multiple of the engine's GPU block size);
    # None: the same as the engine's block
    block_size_tokens: int | None = None
    cascade: CascadeConfig = field(default_factory=CascadeConfig)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------

# Keyed by the lower-cased unit so that `gib` and `GIB` work; the lower-cased forms of binary
# and decimal units never collide, so folding case loses nothing.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
# Bare prefixes are refused rather than guessed: `64G` means 64 * 10^9 to some tools and
# 64 * 2^30 to others, and a 7% error in a capacity goes unnoticed.
_AMBIGUOUS_UNITS = {"k": ("KiB", "kB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB")}
# Kubernetes' `Gi` is not ambiguous, but one spelling per unit keeps configs greppable.
_KUBERNETES_UNITS = {"ki": "KiB", "mi": "MiB", "gi": "GiB", "ti": "TiB"}
_CANONICAL_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "kB", "MB", "GB", "TB")
_SIZE_FORMS = (
    "a whole number of bytes: an int >= 0, or a string such as '4096', '4096B', '512MiB', "
    "'64GiB', '1.5TB' (binary KiB MiB GiB TiB = 1024^n, decimal kB MB GB TB = 1000^n)"
)
_SIZE_RE = re.compile(r"\s*([+-]?)\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
#: the largest size or count a field takes: what a signed 64-bit offset holds (8 EiB). A
#: bigger one is a typo, and past it sizes overflow the C calls and formats below.
MAX_FIELD_INT = 2**63 - 1
#: the longest size text parse_size reads: '9223372036854775807' and a unit fit with room
MAX_SIZE_TEXT = 64
# format_size stops at TiB because parse_size accepts nothing larger: an exact size's text
# must parse back.
_FORMAT_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_size(value: object, field: str) -> int:
    """Return ``value`` as a whole number of bytes, or raise ConfigError naming ``field``.

    Accepts an int >= 0, a whole float, or a string of a number and an optional unit
    (``4096``, ``4096B``, ``2 KiB``, ``512MiB``, ``1.5TB``). Binary units are 1024^n and
    decimal units 1000^n; units fold case only where that stays unambiguous, so ``gib`` is
    GiB and ``gb`` is GB, while a bare ``G`` is refused.
    """
    # bool is an int subclass, and `capacity: yes` is a typo, never a size of 1 byte
    if isinstance(value, bool):
        raise ConfigError(field, value, _SIZE_FORMS, "write a size such as 64GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, _SIZE_FORMS, "sizes cannot be negative")
        return _bounded(value, value, field)
    if isinstance(value, float):
        # Decimal(float) is exact, so 1024.0 passes and 1.5 is caught as a fraction of a byte
        return _whole_bytes(Decimal(value), value, field)
    if not isinstance(value, str):
        raise ConfigError(field, value, _SIZE_FORMS, "write a size such as 64GiB")
    if len(value) > MAX_SIZE_TEXT:  # before the regex and Decimal see thousands of digits
        raise ConfigError(field, value, _SIZE_FORMS + f", at most {MAX_SIZE_TEXT} characters",
                          "write a size such as 64GiB")

    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ConfigError(field, value, _SIZE_FORMS, "write a size such as 64GiB or 4096")
    sign, number, unit = match.groups()
    if sign == "-":
        raise ConfigError(field, value, _SIZE_FORMS, "sizes cannot be negative")
    folded = unit.lower()
    if folded in _AMBIGUOUS_UNITS:
        binary, decimal = _AMBIGUOUS_UNITS[folded]
        raise ConfigError(
            field,
            value,
            _SIZE_FORMS,
            f"'{unit}' is ambiguous: write {number}{binary} (binary) or {number}{decimal} "
            "(decimal)",
        )
    if folded in _KUBERNETES_UNITS:
        raise ConfigError(
            field, value, _SIZE_FORMS, f"write {number}{_KUBERNETES_UNITS[folded]}"
        )
    if folded not in _SIZE_UNITS:
        guess = _closest(unit, _CANONICAL_UNITS)
        hint = f"did you mean {number}{guess}?" if guess else "use one of " + ", ".join(
            _CANONICAL_UNITS
        )
        raise ConfigError(field, value, _SIZE_FORMS, f"unknown unit '{unit}'; {hint}")
    # Enough digits that the product is exact: a rounded product could pass a fraction of a
    # byte off as a whole one.
    with localcontext() as context:
        context.prec = len(number) + 16
        amount = Decimal(number) * _SIZE_UNITS[folded]
    return _whole_bytes(amount, value, field)


def _whole_bytes(amount: Decimal, value: object, field: str) -> int:
    try:
        whole = amount.is_finite() and amount == amount.to_integral_value()
    except InvalidOperation:  # a signalling NaN
        whole = False
    if not whole:
        raise ConfigError(
            field, value, _SIZE_FORMS, "the size must come to a whole number of bytes"
        )
    if amount < 0:
        raise ConfigError(field, value, _SIZE_FORMS, "sizes cannot be negative")
    return _bounded(int(amount), value, field)


def _bounded(number: int, value: object, field: str) -> int:
    if number > MAX_FIELD_INT:
        raise ConfigError(field, value, f"at most {MAX_FIELD_INT} (8 EiB)",
                          "check the number of digits")
    return number


def format_size(n: int) -> str:
    """Render ``n`` bytes for people, in binary units: ``64 GiB``, ``1.5 MiB``, ``512 B``.

    Shows at most two decimals, so the result may be rounded; ``describe`` adds the exact
    byte count where it is.
    """
    return _format_size(n)[0]


def _format_size(n: int) -> tuple[str, bool]:
    """format_size's text, and whether that text is exactly ``n`` bytes."""
    # A programming mistake, not user input: callers format sizes they already validated.
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_size takes an int number of bytes, got {n!r}")
    if n < 0:
        raise ValueError(f"format_size takes a number of bytes >= 0, got {n}")
    for index, (unit, size) in enumerate(_FORMAT_UNITS):
        if n < size:
            continue
        # enough digits for any n: the default 28 made quantize fail past 10^26 bytes
        with localcontext() as context:
            context.prec = len(str(n)) + 4
            shown = (Decimal(n) / size).quantize(Decimal("0.01"))
            # 1048575 B rounds to 1024.00 KiB; one unit up reads better and is as close
            if shown >= 1024 and index > 0:
                unit, size = _FORMAT_UNITS[index - 1]
                shown = (Decimal(n) / size).quantize(Decimal("0.01"))
            text = f"{shown:f}".rstrip("0").rstrip(".")
            return f"{text} {unit}", shown * size == n
    return f"{n} B", True


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


class _Missing:
    """Stands for a key the input lacks, so an error reads ``got <missing>``.

    ``None`` would read as if the user had written ``null``, which is a different mistake.
    """

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
#: what a kind's :meth:`TierConfig.parse_options` passes for a required key the section lacks,
#: so that its error reads ``got <missing>`` (``section.get(key, MISSING)``)
MISSING = _MISSING

_TOP_KEYS = ("tiers", "block_size_tokens", "cascade")
# Keys of vLLM's kv_connector_extra_config that belong to vLLM; kvtier accepts and skips them
# so that the whole extra config can be handed over untouched.
_VLLM_PASSTHROUGH_KEYS = ("spec_name", "spec_module_path", "offload_prompt_only")
# vLLM's name for the offloaded block size; an alias of block_size_tokens
_VLLM_BLOCK_SIZE_KEY = "block_size"
# the extra-config key that points at a kvtier YAML file instead of inline keys
_INCLUDE_KEY = "kvtier_config"
_VLLM_KEYS = _VLLM_PASSTHROUGH_KEYS + (_VLLM_BLOCK_SIZE_KEY, _INCLUDE_KEY)

#: tier kind -> its section class ("module:Class", imported on first use). The one place a
#: kind is registered: the parser, the stack builder, ``describe`` and the CLI read it. A kind
#: from outside kvtier needs no entry: ``kind: my_pkg.tiers:RemoteTierConfig``, or ``kind:
#: RemoteTierConfig`` with ``module_path: my_pkg.tiers``.
TIER_KINDS: Registry[TierConfig] = Registry(
    "tier kind",
    TierConfig,
    {
        "cpu": "kvtier.tiers.cpu.config:CPUTierConfig",
        "lmdb": "kvtier.tiers.disk.config:DiskTierConfig",
        "files": "kvtier.tiers.disk.config:DiskTierConfig",
        "valkey": "kvtier.tiers.valkey.config:ValkeyTierConfig",
        "redis": "kvtier.tiers.valkey.config:ValkeyTierConfig",
    },
    module_key="module_path",
)

# YAML keys that differ from their field names: people write `capacity: 64GiB`, while the
# field keeps its unit in its name.
_TIER_FIELD_BY_KEY = {"capacity": "capacity_bytes"}
_TIER_KEY_BY_FIELD = {f: k for k, f in _TIER_FIELD_BY_KEY.items()}
# the common fields a server-bounded kind (TierConfig.bounded_by_server) takes no key for
_SERVER_BOUNDED_FIELDS = ("capacity_bytes", "eviction", "eviction_module_path")
_TIER_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")


def _tier_keys(cls: type[TierConfig]) -> tuple[str, ...]:
    """The YAML keys a tier section of class ``cls`` accepts, in field order (common first)."""
    skipped = _SERVER_BOUNDED_FIELDS if cls.bounded_by_server else ()
    return tuple(_TIER_KEY_BY_FIELD.get(f.name, f.name) for f in fields(cls) if f.name not in skipped)


def __getattr__(name: str) -> object:
    # The built-in kinds' sections live beside their tiers (kvtier.tiers.cpu.config,
    # kvtier.tiers.disk.config) and import this module; reached lazily here so that the old
    # import path keeps working without a cycle.
    if name == "CPUTierConfig":
        from kvtier.tiers.cpu.config import CPUTierConfig

        return CPUTierConfig
    if name == "DiskTierConfig":
        from kvtier.tiers.disk.config import DiskTierConfig

        return DiskTierConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CASCADE_KEYS = tuple(f.name for f in fields(CascadeConfig))


def _join(path: str, key: object) -> str:
    text = key if isinstance(key, str) and len(key) <= 60 else shown_value(key)
    return f"{path}.{text}" if path else text


def _closest(word: object, choices: tuple[str, ...] | list[str]) -> str | None:
    """The choice nearest to ``word`` ignoring case, or None if nothing is close."""
    if not isinstance(word, str):
        return None
    by_folded = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[found[0]] if found else None


def _choice_fix(value: object, choices: tuple[str, ...]) -> str:
    guess = _closest(value, choices)
    if guess is not None:
        return f"did you mean '{guess}'?"
    return "write one of " + ", ".join(choices)


def _check_keys(section: Mapping, valid: tuple[str, ...], path: str, what: str) -> None:
    """Refuse any key outside ``valid``: a typo silently ignored is a setting silently lost."""
    for key in section:
        if isinstance(key, str) and key in valid:
            continue
        guess = _closest(key, valid)
        fix = f"did you mean '{guess}'?" if guess else "remove it or use one of the keys above"
        raise ConfigError(
            _join(path, key), key, f"a key of {what}: " + ", ".join(valid), fix
        )


def _require_mapping(value: object, path: str, what: str, fix: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(path, value, f"a mapping ({what})", fix)
    return value


def positive_int(value: object, field: str) -> int:
    """``value`` as an int >= 1 (numpy integers too), or a ConfigError naming ``field``."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # refuses floats and strings
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ConfigError(field, value, "an integer >= 1", "write a whole number such as 256")
    return _bounded(number, value, field)


def positive_size(value: object, field: str) -> int:
    """A size > 0 in bytes (see :func:`parse_size`), or a ConfigError naming ``field``."""
    size = parse_size(value, field)
    if size == 0:
        raise ConfigError(field, value, "a size > 0", "write a size such as 512MiB")
    return size


def non_empty_str(value: object, field: str, expected: str, fix: str) -> str:
    """A non-blank string (an ``os.PathLike`` becomes one), or a ConfigError naming ``field``."""
    if isinstance(value, os.PathLike):
        value = os.fsdecode(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, value, expected, fix)
    return value


def parse_choice(value: object, field: str, choices: tuple[str, ...], bools: bool = False) -> str:
    """One of ``choices``, or a ConfigError naming ``field`` that suggests the nearest.

    ``bools``: a YAML boolean stands for on/off (YAML 1.1 reads an unquoted ``off`` as false).
    """
    if bools and isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(field, value, "one of " + ", ".join(choices), _choice_fix(value, choices))
    return value


def _section_class(section: Mapping, path: str) -> type[TierConfig]:
    """The section class ``kind`` (and ``module_path``) name: registered or out-of-tree."""
    kind = section.get("kind", _MISSING)
    module_path = section.get("module_path")
    if module_path is not None:
        module_path = non_empty_str(
            module_path, _join(path, "module_path"), "a dotted module path such as my_pkg.tiers",
            "write the module that defines the kind's section class",
        )
    out_of_tree = module_path is not None or TIER_KINDS.is_class_path(kind)
    if not isinstance(kind, str) or not (kind in TIER_KINDS or out_of_tree):
        names = TIER_KINDS.names()
        fix = _choice_fix(kind, names) if kind is not _MISSING else (
            "add kind: " + ", kind: ".join(names)
        )
        raise ConfigError(
            _join(path, "kind"), kind,
            "one of " + ", ".join(names) + " (or a class path module:Class of your own kind)", fix,
        )
    return TIER_KINDS.resolve(kind, module_path, field=_join(path, "kind"))


def _parse_tier(section: object, path: str) -> TierConfig:
    section = _require_mapping(
        section,
        path,
        "one tier",
        "write the tier as a mapping such as {name: cpu, kind: cpu, capacity: 64GiB}",
    )
    # kind first: it decides which keys the rest of the section may hold
    cls = _section_class(section, path)
    kind = section["kind"]
    if cls.bounded_by_server:
        for key in ("capacity", "eviction", "eviction_module_path"):
            if key in section:
                raise ConfigError(
                    _join(path, key), section[key], f"no {key} in a {kind} tier",
                    "remove it: the server's own limit and eviction (maxmemory with "
                    "allkeys-lru, say) bound and evict this tier",
                )
    valid = _tier_keys(cls)
    for key in section:
        if not isinstance(key, str) or key in valid:
            continue
        owners = _kinds_taking(key)
        if owners:
            raise ConfigError(
                _join(path, key),
                key,
                f"a key of a {kind} tier: " + ", ".join(valid),
                f"'{key}' applies only to tiers of kind {' and '.join(owners)}; remove it here",
            )
    _check_keys(section, valid, path, f"a {kind} tier")

    receives = "saved"
    if "receives" in section:
        if cls.role == "first":
            raise ConfigError(
                _join(path, "receives"), section["receives"],
                "no receives in the first tier: it receives every block from the GPU",
                "remove it here; set receives: saved or evicted on the tiers below",
            )
        receives = parse_choice(section["receives"], _join(path, "receives"), RECEIVES)

    default_name = kind if kind in TIER_KINDS else cls.__name__
    name = section.get("name", default_name)
    if not isinstance(name, str) or not _TIER_NAME_RE.fullmatch(name):
        raise ConfigError(
            _join(path, "name"),
            name,
            "a non-empty string of letters, digits, '_' and '-'",
            "write a name such as nvme0 (quote it if YAML reads it as a number)",
        )

    if cls.bounded_by_server:
        options: dict[str, Any] = cls.parse_options(section, path, name)
        return cls(
            name=name, kind=kind, capacity_bytes=0, eviction="server",
            module_path=section.get("module_path"), receives=receives,
            **options,
        )

    capacity = section.get("capacity", _MISSING)
    if capacity is _MISSING:
        raise ConfigError(
            _join(path, "capacity"), capacity, _SIZE_FORMS, "add capacity: such as 64GiB"
        )
    capacity_bytes = positive_size(capacity, _join(path, "capacity"))

    eviction_module_path = section.get("eviction_module_path")
    if eviction_module_path is not None:
        eviction_module_path = non_empty_str(
            eviction_module_path,
            _join(path, "eviction_module_path"),
            "a dotted module path such as my_pkg.policies",
            "write the module that defines the policy class",
        )
    eviction = section.get("eviction", "lru")
    if eviction_module_path is None:
        builtin = POLICIES.names()  # others load through eviction_module_path
        if not isinstance(eviction, str) or eviction not in builtin:
            raise ConfigError(
                _join(path, "eviction"),
                eviction,
                "one of " + ", ".join(builtin)
                + " (or any class name when eviction_module_path is set)",
                _choice_fix(eviction, builtin)
                + "; set eviction_module_path to load an out-of-tree policy",
            )
    else:
        eviction = non_empty_str(
            eviction,
            _join(path, "eviction"),
            f"the name of a policy class in {eviction_module_path}",
            "write the class name",
        )

    return cls(
        name=name,
        kind=kind,
        capacity_bytes=capacity_bytes,
        eviction=eviction,
        eviction_module_path=eviction_module_path,
        module_path=section.get("module_path"),
        receives=receives,
        **cls.parse_options(section, path, name),
    )


def parse_tier(section: object, field: str) -> TierConfig:
    """One tier's section (a mapping from YAML) at ``field`` (``tiers[1]``), as its kind's
    frozen section; a :class:`ConfigError` naming the key, value, choices and fix."""
    return _parse_tier(section, field)


def _kinds_taking(key: str) -> list[str]:
    """The registered kinds whose section has ``key`` (for a key written under another kind)."""
    owners = []
    for kind in TIER_KINDS.names():
        if key in _tier_keys(TIER_KINDS.resolve(kind, field="kind")):
            owners.append(kind)
    return owners


def _parse_tiers(value: object) -> tuple[TierConfig, ...]:
    if value is _MISSING:
        raise ConfigError(
            "tiers",
            value,
            "a non-empty list of tiers, the cpu tier first",
            "add tiers: with at least - {name: cpu, kind: cpu, capacity: 4GiB}",
        )
    # a bare string is a sequence too, but never a list of tiers
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            "tiers",
            value,
            "a list of tier mappings",
            "write each tier as a list item starting with '- '",
        )
    if not value:
        raise ConfigError(
            "tiers",
            value,
            "at least one tier, the cpu tier first",
            "add - {name: cpu, kind: cpu, capacity: 4GiB}",
        )

    tiers: list[TierConfig] = []
    index_by_name: dict[str, int] = {}
    for index, section in enumerate(value):
        path = f"tiers[{index}]"
        tier = _parse_tier(section, path)
        if tier.name in index_by_name:
            raise ConfigError(
                f"{path}.name",
                tier.name,
                f"a name unique in the stack (tiers[{index_by_name[tier.name]}] has it)",
                "give each tier its own name (a tier without one is named after its kind)",
            )
        index_by_name[tier.name] = index
        tiers.append(tier)

    # Checked after every tier parsed, so that a misplaced cpu tier gets the better message.
    first_indexes = [i for i, tier in enumerate(tiers) if tier.role == "first"]
    if tiers[0].role != "first":
        where = f"move tiers[{first_indexes[0]}] (kind {tiers[first_indexes[0]].kind}) first" if first_indexes else (
            "add a tier of kind cpu first"
        )
        raise ConfigError(
            "tiers[0].kind",
            tiers[0].kind,
            "'cpu': every load into the GPU comes from the cpu tier, so it heads the stack",
            where,
        )
    if len(first_indexes) > 1:
        extra = first_indexes[1]
        raise ConfigError(
            f"tiers[{extra}].kind",
            tiers[extra].kind,
            "exactly one cpu tier (tiers[0])",
            "merge the cpu tiers into one, or make this one a lower kind ("
            + ", ".join(k for k in TIER_KINDS.names() if k not in _first_kinds()) + ")",
        )
    return tuple(tiers)


def _first_kinds() -> list[str]:
    return [k for k in TIER_KINDS.names() if TIER_KINDS.resolve(k, field="kind").role == "first"]


def _parse_cascade(value: object) -> CascadeConfig:
    section = _require_mapping(
        value,
        "cascade",
        "of " + ", ".join(_CASCADE_KEYS),
        "write cascade: {write_policy: write_back} or leave the key out for defaults",
    )
    _check_keys(section, _CASCADE_KEYS, "cascade", "cascade")
    settings: dict[str, Any] = {}
    if "write_policy" in section:
        settings["write_policy"] = parse_choice(
            section["write_policy"], "cascade.write_policy", WRITE_POLICIES
        )
    for key in ("max_demote_bytes_per_step", "max_promote_bytes_per_step"):
        if key in section:
            settings[key] = positive_size(section[key], f"cascade.{key}")
    return CascadeConfig(**settings)


def _parse_document(document: object, root: str, from_yaml: bool) -> KvtierConfig:
    """Build a KvtierConfig from one mapping.

    ``from_yaml``: the mapping came from a kvtier YAML file or text, which holds kvtier keys
    only; vLLM's keys (and kvtier_config) belong in vLLM's extra config, and accepting them in
    the file would let a setting look effective where it is not.
    """
    document = _require_mapping(
        document,
        root,
        "of kvtier keys: " + ", ".join(_TOP_KEYS),
        "write the settings as key: value lines, starting with tiers:",
    )
    valid = _TOP_KEYS if from_yaml else _TOP_KEYS + _VLLM_KEYS
    for key in document:
        if from_yaml and key in _VLLM_KEYS:
            fix = (
                "a kvtier YAML cannot include another; put its settings here"
                if key == _INCLUDE_KEY
                else f"move '{key}' to vLLM's kv_connector_extra_config"
            )
            raise ConfigError(
                key, document[key], "a kvtier key: " + ", ".join(_TOP_KEYS), fix
            )
    _check_keys(document, valid, "", "the kvtier configuration")

    if not from_yaml and _INCLUDE_KEY in document:
        return _parse_include(document)

    tiers = _parse_tiers(document.get("tiers", _MISSING))
    block_size_tokens = document.get("block_size_tokens")
    if block_size_tokens is not None:
        block_size_tokens = positive_int(block_size_tokens, "block_size_tokens")
    block_size_tokens = _merge_block_size(document, block_size_tokens)
    cascade = (
        _parse_cascade(document["cascade"]) if "cascade" in document else CascadeConfig()
    )
    return KvtierConfig(tiers=tiers, block_size_tokens=block_size_tokens, cascade=cascade)


def _merge_block_size(document: Mapping, block_size_tokens: int | None) -> int | None:
    """Fold vLLM's ``block_size`` into ``block_size_tokens``; both must agree if both given."""
    if _VLLM_BLOCK_SIZE_KEY not in document:
        return block_size_tokens
    block_size = positive_int(document[_VLLM_BLOCK_SIZE_KEY], _VLLM_BLOCK_SIZE_KEY)
    if block_size_tokens is not None and block_size_tokens != block_size:
        raise ConfigError(
            _VLLM_BLOCK_SIZE_KEY,
            block_size,
            f"the same value as block_size_tokens ({block_size_tokens}): both set the "
            "offloaded block size in tokens",
            "give only one of block_size and block_size_tokens",
        )
    return block_size


def _parse_include(document: Mapping) -> KvtierConfig:
    """The extra-config form that names a kvtier YAML file in ``kvtier_config``."""
    inline = [key for key in _TOP_KEYS if key in document]
    if inline:
        raise ConfigError(
            _INCLUDE_KEY,
            document[_INCLUDE_KEY],
            f"no inline kvtier keys beside it (found {', '.join(inline)})",
            "give either kvtier_config or inline keys (tiers, cascade, block_size_tokens), "
            "not both",
        )
    include = non_empty_str(
        document[_INCLUDE_KEY],
        _INCLUDE_KEY,
        "the path of a kvtier YAML file",
        "write the path, e.g. kvtier_config: tiers.yaml",
    )
    text = _read_file(include, _INCLUDE_KEY)
    loaded = _parse_document(_load_yaml(text, include), include, from_yaml=True)
    block_size_tokens = _merge_block_size(document, loaded.block_size_tokens)
    if block_size_tokens == loaded.block_size_tokens:
        return loaded
    return KvtierConfig(
        tiers=loaded.tiers, block_size_tokens=block_size_tokens, cascade=loaded.cascade
    )


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


#: the most nodes a kvtier YAML document may hold once its aliases are expanded. A real
#: config has a few dozen; a few hundred bytes of nested aliases expand to billions.
MAX_YAML_NODES = 10_000


class _ExpansionError(yaml.composer.ComposerError):
    """A document too large once its aliases are expanded, or recursive through them."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and documents too large once expanded.

    PyYAML keeps the last of two equal keys without a word; a tier written twice would lose
    its first half as silently as a misspelt key would.

    Aliases stay allowed (``<<: *disk`` overrides are worth having), but the composed
    document is measured with every alias expanded before anything is built from it: the
    node graph shares an aliased node, while what is built from it (and any repr of it in
    an error message) is as large as the expansion. Refusing aliases outright was the
    alternative; counting keeps merges and bounds the same attack.
    """

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` overrides are what a merge is for
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable: the base class reports it with its mark
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {shown_value(key)}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(root: yaml.Node) -> None:
    """Raise a composer error at the node whose expansion passes :data:`MAX_YAML_NODES`
    (the deepest such node: where the aliases multiply), or at an alias of its own ancestor."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    def size(node: yaml.Node) -> int:  # memoized: each distinct node is walked once
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in visiting:
            raise _ExpansionError(
                None, None, "found an alias of a node that contains it (a recursive document)",
                node.start_mark)
        visiting.add(id(node))
        total = 1 + sum(size(child) for child in children(node))
        visiting.discard(id(node))
        sizes[id(node)] = total
        return total

    if size(root) <= MAX_YAML_NODES:
        return
    node = root
    while True:
        larger = [child for child in children(node) if sizes[id(child)] > MAX_YAML_NODES]
        if not larger:
            break
        node = larger[0]
    raise _ExpansionError(
        None, None,
        f"this node expands to {sizes[id(node)]:,} nodes through its aliases, more than the "
        f"{MAX_YAML_NODES:,} a kvtier configuration may hold (nested aliases)",
        node.start_mark)


def _load_yaml(text: str, where: str) -> object:
    try:
        # a SafeLoader subclass, so YAML tags cannot build arbitrary Python objects
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as error:
        raise _yaml_error(error, text, where) from None
    except RecursionError:  # PyYAML composes and builds recursively
        raise ConfigError(where, text[:80], "YAML nested at most a few hundred levels deep",
                          "flatten the document") from None
    except ValueError as error:  # e.g. an int of more than 4,300 digits
        raise ConfigError(where, text[:80], f"valid YAML values ({error})",
                          "check the numbers in the document") from None


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_error(error: yaml.YAMLError, text: str, where: str) -> ConfigError:
    """A ConfigError that points at the line and column PyYAML blamed."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None:
        # an unclosed bracket is reported at the end of input; where it opened is the clue
        problem = f"{problem}, {context} at {_at(context_mark)}"
    if mark is None:
        return ConfigError(where, text[:80], f"valid YAML ({problem})")
    lines = text.splitlines()
    line = lines[mark.line].strip() if mark.line < len(lines) else ""
    fix = (f"write the values at {_at(mark)} out instead of through nested aliases"
           if isinstance(error, _ExpansionError) else
           f"check the indentation, quoting and brackets at {_at(mark)}")
    return ConfigError(f"{where} {_at(mark)}", line or "<end of input>", f"valid YAML ({problem})", fix)


def _read_file(path: str | os.PathLike, field: str) -> str:
    shown = os.fsdecode(path)
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read()
    except FileNotFoundError:
        raise ConfigError(
            field,
            shown,
            "the path of an existing kvtier YAML file",
            f"check the path (it resolves to {os.path.abspath(shown)}), or pass the YAML text "
            "itself",
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            field, shown, "a YAML file, not a directory", "name the file inside it"
        ) from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            field, shown, "a UTF-8 text file", f"re-save it as UTF-8 ({error.reason})"
        ) from None
    except OSError as error:
        raise ConfigError(
            field, shown, "a readable YAML file", f"fix the file: {error.strerror}"
        ) from None


def _looks_like_path(text: str) -> bool:
    """Whether a str that names no existing file was meant as a path rather than YAML text.

    One line with no colon cannot be a useful YAML document; a one-line ``*.yaml`` with a
    colon not followed by a space is a path such as ``C:/kvtier.yaml`` (a YAML key needs
    ``: ``), while ``kvtier_config: tiers.yaml`` stays YAML.
    """
    if "\n" in text:
        return False
    if ":" not in text:
        return True
    return text.rstrip().endswith((".yaml", ".yml")) and ": " not in text


def load_config(source: object) -> KvtierConfig:
    """Parse ``source`` into a KvtierConfig, raising ConfigError for anything wrong with it.

    ``source`` is one of:

    * a KvtierConfig, returned as is;
    * a dict: the kvtier schema, or vLLM's ``kv_connector_extra_config`` (whose keys
      spec_name, spec_module_path and offload_prompt_only are skipped, ``block_size`` is an
      alias of block_size_tokens, and ``kvtier_config`` names a YAML file to load instead of
      inline keys);
    * a path (str or os.PathLike) to a kvtier YAML file;
    * YAML text: a str holding a newline or a colon that names no existing file.

    A YAML file or text holds kvtier keys only (tiers, cascade, block_size_tokens).
    """
    if isinstance(source, KvtierConfig):
        return source
    if isinstance(source, Mapping):
        return _parse_document(source, "config", from_yaml=False)
    if isinstance(source, os.PathLike):
        shown = os.fsdecode(source)
        text = _read_file(source, "config")
        return _parse_document(_load_yaml(text, shown), shown, from_yaml=True)
    if isinstance(source, str):
        if not source.strip():
            raise ConfigError(
                "config",
                source,
                "a path to a kvtier YAML file, YAML text, a dict or a KvtierConfig",
                "pass the path of a YAML file such as examples/cpu-only.yaml",
            )
        if os.path.isfile(source) or _looks_like_path(source):
            text = _read_file(source, "config")
            return _parse_document(_load_yaml(text, source), source, from_yaml=True)
        return _parse_document(_load_yaml(source, "YAML text"), "YAML text", from_yaml=True)
    raise ConfigError(
        "config",
        source,
        "a path to a kvtier YAML file, YAML text, a dict or a KvtierConfig",
        "pass one of those",
    )


# --------------------------------------------------------------------------------------------
# Describe
# --------------------------------------------------------------------------------------------


def _describe_size(n: int) -> str:
    """format_size, plus the exact count where the human form had to round."""
    shown, exact = _format_size(n)
    return shown if exact else f"{shown} ({n} B)"


def describe(config: KvtierConfig) -> str:
    """A multi-line summary of the stack, fastest tier first, for ``kvtier config check``."""
    rows = []
    for index, tier in enumerate(config.tiers):
        eviction = tier.eviction
        if tier.eviction_module_path is not None:
            eviction += f" (from {tier.eviction_module_path})"
        where = tier.location() or "(none)"
        options = tier.options_text()
        if index:  # how the tier fills: the first tier receives every block from the GPU
            options = f"receives={tier.receives}  {options}".rstrip()
        rows.append(
            (
                f"[{index}]",
                tier.name,
                tier.kind,
                _describe_size(tier.capacity_bytes),
                f"eviction={eviction}",
                f"at={where}",
                options,
            )
        )
    # columns padded to their widest cell, so that tiers read as a table
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    count = len(config.tiers)
    lines = [f"kvtier stack: {count} tier{'s' if count != 1 else ''}, fastest first"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  " + "  ".join(cells).rstrip())
    block = config.block_size_tokens
    lines.append(
        "block_size_tokens: "
        + (f"{block}" if block is not None else "the engine's GPU block size")
    )
    cascade = config.cascade
    lines.append(
        f"cascade: write_policy={cascade.write_policy}  "
        f"max_demote_bytes_per_step={_describe_size(cascade.max_demote_bytes_per_step)}  "
        f"max_promote_bytes_per_step={_describe_size(cascade.max_promote_bytes_per_step)}"
    )
    return "\n".join(lines)

"""The tier-kind registry: kind name -> its section class, imported when first named.

The parser, the stack builder, ``describe`` and the CLI look kinds up here; a kind's own
module is never imported by name, so a new kind is one new file and one entry below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from kvtier.config.checks import MISSING, choice_fix, join_key, non_empty_str
from kvtier.config.schema import TierConfig
from kvtier.errors import ConfigError
from kvtier.registry import Registry

__all__ = ["TIER_KINDS", "first_kinds", "kinds_taking", "section_class", "tier_keys"]

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


def tier_keys(cls: type[TierConfig]) -> tuple[str, ...]:
    """The YAML keys a tier section of class ``cls`` accepts, in field order (common first)."""
    skipped = _SERVER_BOUNDED_FIELDS if cls.bounded_by_server else ()
    return tuple(_TIER_KEY_BY_FIELD.get(f.name, f.name) for f in fields(cls) if f.name not in skipped)


def section_class(section: Mapping, path: str) -> type[TierConfig]:
    """The section class ``kind`` (and ``module_path``) name: registered or out-of-tree."""
    kind = section.get("kind", MISSING)
    module_path = section.get("module_path")
    if module_path is not None:
        module_path = non_empty_str(
            module_path,
            join_key(path, "module_path"),
            "a dotted module path such as my_pkg.tiers",
            "write the module that defines the kind's section class",
        )
    out_of_tree = module_path is not None or TIER_KINDS.is_class_path(kind)
    if not isinstance(kind, str) or not (kind in TIER_KINDS or out_of_tree):
        names = TIER_KINDS.names()
        fix = choice_fix(kind, names) if kind is not MISSING else ("add kind: " + ", kind: ".join(names))
        raise ConfigError(
            join_key(path, "kind"),
            kind,
            "one of " + ", ".join(names) + " (or a class path module:Class of your own kind)",
            fix,
        )
    return TIER_KINDS.resolve(kind, module_path, field=join_key(path, "kind"))


def kinds_taking(key: str) -> list[str]:
    """The registered kinds whose section has ``key`` (for a key written under another kind)."""
    owners = []
    for kind in TIER_KINDS.names():
        if key in tier_keys(TIER_KINDS.resolve(kind, field="kind")):
            owners.append(kind)
    return owners


def first_kinds() -> list[str]:
    return [k for k in TIER_KINDS.names() if TIER_KINDS.resolve(k, field="kind").role == "first"]

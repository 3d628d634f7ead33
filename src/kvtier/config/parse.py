"""Parse one configuration document (a mapping) into a :class:`~kvtier.config.schema.KvtierConfig`.

Every key is checked here or in its kind's :meth:`~kvtier.config.schema.TierConfig.parse_options`;
errors name the key, the value, what is valid and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvtier.config.checks import (
    MISSING,
    check_keys,
    choice_fix,
    join_key,
    non_empty_str,
    parse_choice,
    require_mapping,
)
from kvtier.config.kinds import TIER_KINDS, first_kinds, kinds_taking, section_class, tier_keys
from kvtier.config.schema import (
    RECEIVES,
    WRITE_POLICIES,
    CascadeConfig,
    KvtierConfig,
    MetricsConfig,
    MissCausesConfig,
    TierConfig,
)
from kvtier.config.source import load_yaml, read_file
from kvtier.config.units import SIZE_FORMS, positive_int, positive_size
from kvtier.errors import ConfigError
from kvtier.policies import POLICIES

__all__ = ["TOP_KEYS", "parse_document", "parse_tier"]

#: the keys of a kvtier configuration document (YAML file, or beside vLLM's in its extra config)
TOP_KEYS = ("tiers", "block_size_tokens", "cascade", "metrics", "miss_causes")
# Keys of vLLM's kv_connector_extra_config that belong to vLLM; kvtier accepts and skips them
# so that the whole extra config can be handed over untouched.
_VLLM_PASSTHROUGH_KEYS = ("spec_name", "spec_module_path", "offload_prompt_only")
# vLLM's name for the offloaded block size; an alias of block_size_tokens
_VLLM_BLOCK_SIZE_KEY = "block_size"
# the extra-config key that points at a kvtier YAML file instead of inline keys
_INCLUDE_KEY = "kvtier_config"
_VLLM_KEYS = _VLLM_PASSTHROUGH_KEYS + (_VLLM_BLOCK_SIZE_KEY, _INCLUDE_KEY)
_TIER_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")

#: the fewest keys a cause sketch remembers (one bucket of 4 ways)
MIN_SKETCH_KEYS = 4
_CASCADE_KEYS = tuple(f.name for f in fields(CascadeConfig))
_METRICS_KEYS = tuple(f.name for f in fields(MetricsConfig))
#: the longest stats_interval_s: a day (a thread cannot wait for ever, nor for 1e300 s)
MAX_STATS_INTERVAL_S = 86400


def _parse_tier(section: object, path: str) -> TierConfig:
    section = require_mapping(
        section,
        path,
        "one tier",
        "write the tier as a mapping such as {name: cpu, kind: cpu, capacity: 64GiB}",
    )
    # kind first: it decides which keys the rest of the section may hold
    cls = section_class(section, path)
    kind = section["kind"]
    if cls.bounded_by_server:
        for key in ("capacity", "eviction", "eviction_module_path"):
            if key in section:
                raise ConfigError(
                    join_key(path, key),
                    section[key],
                    f"no {key} in a {kind} tier",
                    "remove it: the server's own limit and eviction (maxmemory with "
                    "allkeys-lru, say) bound and evict this tier",
                )
    valid = tier_keys(cls)
    for key in section:
        if not isinstance(key, str) or key in valid:
            continue
        owners = kinds_taking(key)
        if owners:
            raise ConfigError(
                join_key(path, key),
                key,
                f"a key of a {kind} tier: " + ", ".join(valid),
                f"'{key}' applies only to tiers of kind {' and '.join(owners)}; remove it here",
            )
    check_keys(section, valid, path, f"a {kind} tier")

    receives = "saved"
    if "receives" in section:
        if cls.role == "first":
            raise ConfigError(
                join_key(path, "receives"),
                section["receives"],
                "no receives in the first tier: it receives every block from the GPU",
                "remove it here; set receives: saved or evicted on the tiers below",
            )
        receives = parse_choice(section["receives"], join_key(path, "receives"), RECEIVES)

    default_name = kind if kind in TIER_KINDS else cls.__name__
    name = section.get("name", default_name)
    if not isinstance(name, str) or not _TIER_NAME_RE.fullmatch(name):
        raise ConfigError(
            join_key(path, "name"),
            name,
            "a non-empty string of letters, digits, '_' and '-'",
            "write a name such as nvme0 (quote it if YAML reads it as a number)",
        )

    if cls.bounded_by_server:
        options: dict[str, Any] = cls.parse_options(section, path, name)
        return cls(
            name=name,
            kind=kind,
            capacity_bytes=0,
            eviction="server",
            module_path=section.get("module_path"),
            receives=receives,
            **options,
        )

    capacity = section.get("capacity", MISSING)
    if capacity is MISSING:
        raise ConfigError(join_key(path, "capacity"), capacity, SIZE_FORMS, "add capacity: such as 64GiB")
    capacity_bytes = positive_size(capacity, join_key(path, "capacity"))

    eviction_module_path = section.get("eviction_module_path")
    if eviction_module_path is not None:
        eviction_module_path = non_empty_str(
            eviction_module_path,
            join_key(path, "eviction_module_path"),
            "a dotted module path such as my_pkg.policies",
            "write the module that defines the policy class",
        )
    eviction = section.get("eviction", "lru")
    if eviction_module_path is None:
        builtin = POLICIES.names()  # others load through eviction_module_path
        if not isinstance(eviction, str) or eviction not in builtin:
            raise ConfigError(
                join_key(path, "eviction"),
                eviction,
                "one of " + ", ".join(builtin) + " (or any class name when eviction_module_path is set)",
                choice_fix(eviction, builtin) + "; set eviction_module_path to load an out-of-tree policy",
            )
    else:
        eviction = non_empty_str(
            eviction,
            join_key(path, "eviction"),
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


def _parse_tiers(value: object) -> tuple[TierConfig, ...]:
    if value is MISSING:
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
        where = (
            f"move tiers[{first_indexes[0]}] (kind {tiers[first_indexes[0]].kind}) first"
            if first_indexes
            else ("add a tier of kind cpu first")
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
            + ", ".join(k for k in TIER_KINDS.names() if k not in first_kinds())
            + ")",
        )
    return tuple(tiers)


def _parse_cascade(value: object) -> CascadeConfig:
    section = require_mapping(
        value,
        "cascade",
        "of " + ", ".join(_CASCADE_KEYS),
        "write cascade: {write_policy: write_back} or leave the key out for defaults",
    )
    check_keys(section, _CASCADE_KEYS, "cascade", "cascade")
    settings: dict[str, Any] = {}
    if "write_policy" in section:
        settings["write_policy"] = parse_choice(
            section["write_policy"], "cascade.write_policy", WRITE_POLICIES
        )
    for key in ("max_demote_bytes_per_step", "max_promote_bytes_per_step"):
        if key in section:
            settings[key] = positive_size(section[key], f"cascade.{key}")
    return CascadeConfig(**settings)


def _parse_metrics(value: object) -> MetricsConfig:
    section = require_mapping(
        value,
        "metrics",
        "of " + ", ".join(_METRICS_KEYS),
        "e.g. metrics: {port: 9400, stats_file: /run/kvtier/stats.json}, or leave the key out",
    )
    check_keys(section, _METRICS_KEYS, "metrics", "metrics")
    settings: dict[str, Any] = {}
    port = section.get("port")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                "metrics.port", port, "a TCP port, 0 to 65535", "write e.g. port: 9400 (0: any free port)"
            )
        settings["port"] = port
    if "addr" in section:
        settings["addr"] = non_empty_str(
            section["addr"], "metrics.addr", "an address to bind", "write e.g. addr: 127.0.0.1"
        )
    for key, what, example in (
        ("unix_socket", "the path of a Unix socket to create", "/run/user/UID/kvtier-metrics.sock"),
        ("stats_file", "the path of a file to write", "/run/kvtier/stats.json"),
    ):
        if section.get(key) is not None:
            settings[key] = non_empty_str(
                section[key], f"metrics.{key}", what, f"write e.g. {key}: {example}"
            )
    if "stats_interval_s" in section:
        interval = section["stats_interval_s"]
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval <= MAX_STATS_INTERVAL_S
        ):
            raise ConfigError(
                "metrics.stats_interval_s",
                interval,
                f"a number of seconds > 0 and at most {MAX_STATS_INTERVAL_S} (a day)",
                "write e.g. stats_interval_s: 5",
            )
        settings["stats_interval_s"] = float(interval)
    return MetricsConfig(**settings)


def _parse_miss_causes(value: object) -> MissCausesConfig:
    """``miss_causes: off`` (or false), or ``{keys: N}``."""
    if value is False or value == "off":
        return MissCausesConfig(keys=0)
    section = require_mapping(
        value,
        "miss_causes",
        "off, or a mapping of keys",
        "write miss_causes: {keys: 1000000}, or miss_causes: off (leave it out: sized from the stack)",
    )
    check_keys(section, ("keys",), "miss_causes", "miss_causes")
    if "keys" not in section:
        return MissCausesConfig()
    keys = positive_int(section["keys"], "miss_causes.keys")
    if keys < MIN_SKETCH_KEYS:
        raise ConfigError(
            "miss_causes.keys",
            keys,
            f"at least {MIN_SKETCH_KEYS} keys",
            "remember more keys (about 5.3 bytes each), or write miss_causes: off",
        )
    return MissCausesConfig(keys=keys)


def parse_document(document: object, root: str, from_yaml: bool) -> KvtierConfig:
    """Build a KvtierConfig from one mapping.

    ``from_yaml``: the mapping came from a kvtier YAML file or text, which holds kvtier keys
    only; vLLM's keys (and kvtier_config) belong in vLLM's extra config, and accepting them in
    the file would let a setting look effective where it is not.
    """
    document = require_mapping(
        document,
        root,
        "of kvtier keys: " + ", ".join(TOP_KEYS),
        "write the settings as key: value lines, starting with tiers:",
    )
    valid = TOP_KEYS if from_yaml else TOP_KEYS + _VLLM_KEYS
    for key in document:
        if from_yaml and key in _VLLM_KEYS:
            fix = (
                "a kvtier YAML cannot include another; put its settings here"
                if key == _INCLUDE_KEY
                else f"move '{key}' to vLLM's kv_connector_extra_config"
            )
            raise ConfigError(key, document[key], "a kvtier key: " + ", ".join(TOP_KEYS), fix)
    check_keys(document, valid, "", "the kvtier configuration")

    if not from_yaml and _INCLUDE_KEY in document:
        return _parse_include(document)

    tiers = _parse_tiers(document.get("tiers", MISSING))
    block_size_tokens = document.get("block_size_tokens")
    if block_size_tokens is not None:
        block_size_tokens = positive_int(block_size_tokens, "block_size_tokens")
    block_size_tokens = _merge_block_size(document, block_size_tokens)
    cascade = _parse_cascade(document["cascade"]) if "cascade" in document else CascadeConfig()
    metrics = _parse_metrics(document["metrics"]) if "metrics" in document else MetricsConfig()
    miss_causes = (
        _parse_miss_causes(document["miss_causes"]) if "miss_causes" in document else MissCausesConfig()
    )
    return KvtierConfig(
        tiers=tiers,
        block_size_tokens=block_size_tokens,
        cascade=cascade,
        metrics=metrics,
        miss_causes=miss_causes,
    )


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
    inline = [key for key in TOP_KEYS if key in document]
    if inline:
        raise ConfigError(
            _INCLUDE_KEY,
            document[_INCLUDE_KEY],
            f"no inline kvtier keys beside it (found {', '.join(inline)})",
            "give either kvtier_config or inline keys (tiers, cascade, block_size_tokens, "
            "metrics, miss_causes), not both",
        )
    include = non_empty_str(
        document[_INCLUDE_KEY],
        _INCLUDE_KEY,
        "the path of a kvtier YAML file",
        "write the path, e.g. kvtier_config: tiers.yaml",
    )
    text = read_file(include, _INCLUDE_KEY)
    loaded = parse_document(load_yaml(text, include), include, from_yaml=True)
    block_size_tokens = _merge_block_size(document, loaded.block_size_tokens)
    if block_size_tokens == loaded.block_size_tokens:
        return loaded
    return dataclasses.replace(loaded, block_size_tokens=block_size_tokens)

"""From SGLang's storage settings and host pool to kvtier's tiers, keys and layout fingerprint.

Pure functions on small values: nothing here imports SGLang (or torch), so the CI without
SGLang covers them. SGLang hands a storage backend one ``HiCacheStorageConfig`` per rank (the
parallel position, ``model_name``, whether the KV is replicated across ranks — MLA — and
``extra_config``, the JSON of ``--hicache-storage-backend-extra-config``), then its host
pool. Everything kvtier needs is derived from those two, once:

* which keys of the extra config are kvtier's (the rest are read by SGLang's factory and
  cache controller), and the kvtier stack they describe (a YAML path or inline keys);
* which shard of a page this rank holds (every tensor/pipeline/context-parallel rank its
  own; one copy per pipeline stage for MLA, whose KV every tensor-parallel rank holds alike);
* the key of each stored block: a page's hash, its shard and its part (a page whose K and V
  halves lie apart in the host pool is two blocks, each copied in place);
* the :class:`~kvtier.tiers.disk.format.LayoutFingerprint` stamped on every block, naming
  the model, dtype, page geometry, host layout and parallel layout, so that a block written
  under another layout is a miss, never served.

Mistakes raise :class:`~kvtier.errors.ConfigError` naming the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.base import OffloadKey, make_offload_key
from kvtier.config import CONFIG_ENV, KvtierConfig, TierConfig, env_config_path, load_config
from kvtier.config.units import positive_int
from kvtier.errors import ConfigError
from kvtier.tiers.disk.format import LayoutFingerprint, on_disk_block_bytes

__all__ = [
    "CONFIG_KEYS",
    "EXTRA_POOLS",
    "SGLANG_KEYS",
    "PoolFacts",
    "SGLangSettings",
    "ShardFacts",
    "layout_fingerprint",
    "check_pool_name",
    "page_key",
    "pool_tiers",
    "resolve_settings",
]

#: keys of the extra config that SGLang itself reads: the dynamic factory's three, the cache
#: controller's switch to the zero-copy (v1) page interface, heterogeneous-TP head splitting,
#: and the prefetch settings (SGLang 0.5.23 removes these before the backend sees them)
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "tp_lcm_size",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)
#: keys naming a kvtier YAML file instead of inline keys (``kvtier_config`` as under vLLM)
CONFIG_KEYS = ("config", "kvtier_config")
#: the integration's own key: host pages staged at once for a layout copied through a buffer
STAGING_PAGES_KEY = "kvtier_staging_pages"
DEFAULT_STAGING_PAGES = 16
#: at most this many parts per page (the key's group field holds shard * _MAX_PARTS + part)
_MAX_PARTS = 4
#: SGLang's pools kvtier stores besides KV ("kv"): the draft model's KV under speculative
#: decoding, a sidecar whose pages share the KV pool's keys and host slots
EXTRA_POOLS = ("draft",)
#: the name of the stand-in first tier: SGLang's host pool takes the place of kvtier's cpu tier
HOST_TIER_NAME = "sglang-host"
# a stand-in capacity for the host tier when the YAML lists only lower tiers (never allocated)
_STAND_IN_BYTES = 1 << 30
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_TIER_INDEX = re.compile(r"tiers\[(\d+)\]")


@dataclass(frozen=True)
class SGLangSettings:
    """What the extra config says, parsed once (``resolve_settings``)."""

    #: the kvtier stack; tiers[0] stands for SGLang's host pool and is never opened
    config: KvtierConfig
    #: pages a staged layout (layer_first) copies through its buffer at once
    staging_pages: int
    #: whether SGLang's cache controller uses the zero-copy page interface (``interface_v1``)
    interface_v1: bool
    #: the user's own index of tiers[1] (0 when the configuration listed only lower tiers and
    #: the host tier was put in front), for naming a tier in errors as the user wrote it
    first_lower_index: int = 1

    def tier_field(self, index: int) -> str:
        """How errors name ``config.tiers[index]``: by the user's own index."""
        return f"tiers[{index - 1 + self.first_lower_index}]"

    @property
    def lower_tiers(self) -> tuple[TierConfig, ...]:
        """The tiers pages are stored in, fastest first."""
        return self.config.tiers[1:]


def _kvtier_keys(extra: Mapping[str, Any]) -> tuple[object, dict[str, Any]]:
    """(what load_config gets, the integration's keys) from the extra config."""
    inline: dict[str, Any] = {}
    integration: dict[str, Any] = {}
    path: object = None
    for key, value in extra.items():
        if key in SGLANG_KEYS:
            continue
        if key in CONFIG_KEYS:
            if path is not None:
                raise ConfigError(
                    f"hicache-storage-backend-extra-config.{key}",
                    value,
                    "one path to a kvtier YAML file",
                    f"give only one of {', '.join(CONFIG_KEYS)}",
                )
            path = value
        elif key == STAGING_PAGES_KEY:
            integration[key] = value
        else:
            inline[key] = value
    if path is None and not inline:
        path = env_config_path()  # the engine's environment names the YAML (or None)
    if path is not None and inline:
        raise ConfigError(
            "hicache-storage-backend-extra-config",
            sorted(inline),
            "either a kvtier YAML path (config) or inline kvtier keys (tiers, cascade), not both",
            "move the inline keys into the YAML file, or drop config",
        )
    if path is None and not inline:
        raise ConfigError(
            "hicache-storage-backend-extra-config",
            sorted(extra),
            f"the kvtier tiers to store pages in: a YAML path, inline tiers, or {CONFIG_ENV} in "
            "SGLang's environment",
            'add "config": "/etc/kvtier/sglang.yaml" (see examples/sglang/tiers.yaml), or '
            'inline "tiers": [{"name": "nvme", "kind": "lmdb", "path": ..., "capacity": "1TiB"}], '
            f"or export {CONFIG_ENV}=/path/to/tiers.yaml before launching SGLang",
        )
    if path is not None and not isinstance(path, str):
        raise ConfigError(
            "hicache-storage-backend-extra-config.config",
            path,
            "a path to a kvtier YAML file",
            'write it as a string, e.g. "config": "/etc/kvtier/sglang.yaml"',
        )
    return (path if path is not None else inline), integration


def _with_host_tier(source: object) -> tuple[KvtierConfig, bool]:
    """The stack ``source`` describes, with a stand-in host tier first when it lists none.

    A YAML written for vLLM (a cpu tier, then lower tiers) is taken as it is: its cpu tier
    stands for SGLang's host pool, whose size SGLang's own ``--hicache-size`` or
    ``--hicache-ratio`` sets. A YAML listing only lower tiers gets a stand-in in front, so one
    parser (kinds, sizes, typo suggestions) holds whichever form is used.
    """
    if isinstance(source, str):
        from kvtier.config.source import load_yaml, read_file

        document: object = load_yaml(read_file(source, "config"), source)
        shown = source
    else:
        document, shown = source, "hicache-storage-backend-extra-config"
    if not isinstance(document, Mapping):
        raise ConfigError(shown, document, "a mapping with tiers:", "see examples/sglang/tiers.yaml")
    tiers = document.get("tiers")
    shifted = False
    if isinstance(tiers, list) and tiers:
        head = tiers[0]
        shifted = not (isinstance(head, Mapping) and head.get("kind") == "cpu")
    if shifted and isinstance(tiers, list):
        stand_in = {"name": HOST_TIER_NAME, "kind": "cpu", "capacity": _STAND_IN_BYTES}
        document = {**document, "tiers": [stand_in, *tiers]}
    try:
        return load_config(dict(document)), shifted
    except ConfigError as error:
        field = error.field
        if shifted:  # name the user's own index, not the one the stand-in shifted
            field = _TIER_INDEX.sub(lambda m: f"tiers[{int(m.group(1)) - 1}]", field)
        if shown != "hicache-storage-backend-extra-config" and not field.startswith(shown):
            field = f"{shown}: {field}"
        raise ConfigError(field, error.value, error.expected, error.fix) from None


def resolve_settings(extra_config: Mapping[str, Any] | None) -> SGLangSettings:
    """Parse ``extra_config`` (SGLang's ``--hicache-storage-backend-extra-config``).

    Raises :class:`ConfigError` for a missing or doubled kvtier configuration, a bad kvtier
    setting, ``block_size_tokens`` (SGLang's ``--page-size`` is the block), or a stack with
    no tier below the host pool.
    """
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ConfigError(
            "hicache-storage-backend-extra-config",
            extra_config,
            "a JSON object of settings",
            'write it as e.g. {"backend_name": "kvtier", ..., "config": "tiers.yaml"}',
        )
    extra = dict(extra_config or {})
    source, integration = _kvtier_keys(extra)
    config, shifted = _with_host_tier(source)
    if config.block_size_tokens is not None:
        raise ConfigError(
            "block_size_tokens",
            config.block_size_tokens,
            "absent: a stored block is one SGLang page (--page-size tokens)",
            "remove block_size_tokens and set SGLang's --page-size instead",
        )
    if len(config.tiers) < 2:
        raise ConfigError(
            "tiers",
            [tier.name for tier in config.tiers],
            "at least one tier below SGLang's host pool (lmdb, files, valkey ...)",
            "add e.g. {name: nvme, kind: lmdb, path: ~/.cache/kvtier/sglang, capacity: 1TiB}",
        )
    staging = integration.get(STAGING_PAGES_KEY, DEFAULT_STAGING_PAGES)
    staging_pages = positive_int(staging, f"hicache-storage-backend-extra-config.{STAGING_PAGES_KEY}")
    return SGLangSettings(
        config=config,
        staging_pages=staging_pages,
        interface_v1=bool(extra.get("interface_v1", 0)),
        first_lower_index=0 if shifted else 1,
    )


@dataclass(frozen=True)
class ShardFacts:
    """This rank's place in the engine, from SGLang's ``HiCacheStorageConfig``."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    #: every tensor-parallel rank holds the same KV (SGLang's is_mla_model: MLA, DeepSeek V4)
    replicated: bool = False
    #: SGLang backs this rank's pages up (MLA: only the first rank of each replica group)
    writer: bool = True
    model_name: str = ""

    @classmethod
    def from_storage_config(cls, config: Any) -> ShardFacts:
        """From a ``HiCacheStorageConfig`` (read by attribute; SGLang is not imported)."""
        for name, why in (
            ("should_split_heads", "heterogeneous tensor-parallel head splitting (tp_lcm_size)"),
        ):
            if getattr(config, name, False):
                raise ConfigError(
                    f"hicache-storage-backend-extra-config.{'tp_lcm_size'}",
                    getattr(config, "tp_lcm_size", None),
                    f"absent: kvtier stores whole shards, not {why}",
                    "remove tp_lcm_size",
                )
        if int(getattr(config, "dcp_size", 1) or 1) > 1:
            raise ConfigError(
                "dcp_size",
                config.dcp_size,
                "1: decode context parallelism splits MLA pages in a way kvtier does not store",
                "launch without decode context parallelism, or use SGLang's file backend",
            )
        replicated = bool(config.is_mla_model)
        writer = getattr(config, "is_storage_writer", None)
        return cls(
            tp_rank=int(config.tp_rank),
            tp_size=int(config.tp_size),
            pp_rank=int(config.pp_rank),
            pp_size=int(config.pp_size),
            cp_rank=int(getattr(config, "attn_cp_rank", 0) or 0),
            cp_size=int(getattr(config, "attn_cp_size", 1) or 1),
            replicated=replicated,
            writer=bool(writer) if writer is not None else (not replicated or int(config.tp_rank) == 0),
            model_name=str(config.model_name or ""),
        )

    @property
    def shard(self) -> int:
        """Which shard of a page this rank holds: one per pipeline stage and context rank, and
        per tensor rank unless the KV is replicated (then every tensor rank shares it)."""
        stage = self.pp_rank * self.cp_size + self.cp_rank
        return stage if self.replicated else stage * self.tp_size + self.tp_rank

    def parallel_facts(self) -> str:
        """The parallel layout that decides what a shard's bytes are (no tp size when replicated:
        TP=2 and TP=4 engines then hold the same bytes and share blocks)."""
        if self.replicated:
            return f"pp={self.pp_size};cp={self.cp_size};replicated=1"
        return f"tp={self.tp_size};pp={self.pp_size};cp={self.cp_size};replicated=0"

    def for_pool(self, pool: PoolFacts) -> ShardFacts:
        """This rank's shard of ``pool``'s pages. SGLang replicates an MLA model's KV over the
        tensor ranks, but a pool of heads beside it (an MHA draft model's KV) is split per
        rank all the same: its pages are this rank's own, which only this rank writes."""
        if not self.replicated or pool.latent:
            return self
        return dataclasses.replace(self, replicated=False, writer=True)


#: host pool attributes that fix what a page's bytes mean, when the pool has them
_GEOMETRY_ATTRS = (
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "kv_cache_dim",
    "size_per_token",
)


#: what kvtier reads of a host pool: its page geometry and SGLang's flat-page methods
_HOST_POOL_ATTRS = (
    "page_size",
    "dtype",
    "layout",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
)


@dataclass(frozen=True)
class PoolFacts:
    """What a host pool's pages are, read from the pool by attribute (SGLang is not imported)."""

    #: the pool's class (MHATokenToKVPoolHost, MLATokenToKVPoolHost ...)
    pool_class: str
    #: the KV dtype (``torch.bfloat16`` ...)
    dtype: str
    #: tokens per page (SGLang's --page-size)
    page_size: int
    #: the host layout (layer_first, page_first, page_first_direct ...)
    layout: str
    #: (name, value) of every geometry attribute the pool has
    geometry: tuple[tuple[str, int], ...]

    @property
    def latent(self) -> bool:
        """An MLA pool (one latent row per token, the same on every tensor rank)."""
        return any(name == "kv_lora_rank" for name, _ in self.geometry)

    @classmethod
    def from_host_pool(cls, pool: Any, name: str = "kv") -> PoolFacts:
        """The facts of ``pool`` (SGLang's pool ``name``); :class:`ConfigError` naming what is
        missing when it is not a host pool kvtier can read pages of."""
        missing = [attr for attr in _HOST_POOL_ATTRS if not hasattr(pool, attr)]
        if missing:
            raise ConfigError(
                f"hicache host pool {name!r}",
                type(pool).__name__,
                "an SGLang host pool (MHATokenToKVPoolHost, MLATokenToKVPoolHost ...) with "
                + ", ".join(_HOST_POOL_ATTRS),
                f"it lacks {', '.join(missing)}: register SGLang's own host pool, or give the pool "
                "these attributes and methods",
            )
        geometry = tuple(
            (name, int(getattr(pool, name)))
            for name in _GEOMETRY_ATTRS
            if isinstance(getattr(pool, name, None), int) and not isinstance(getattr(pool, name), bool)
        )
        return cls(
            pool_class=type(pool).__name__,
            dtype=str(pool.dtype),
            page_size=int(pool.page_size),
            layout=str(pool.layout),
            geometry=geometry,
        )


def layout_fingerprint(
    pool: PoolFacts,
    shard: ShardFacts,
    *,
    block_bytes: int,
    parts: int,
    staged: bool,
    pool_name: str = "kv",
) -> LayoutFingerprint:
    """The fingerprint of blocks of ``block_bytes``, each one of ``parts`` parts of a page.

    The same for every rank of one engine (the shard rides in the key, not here), so the
    ranks share one store and one capacity: a per-rank fingerprint would make a rank's open
    wipe another's blocks. ``staged``: the page is copied whole through a buffer (its flat
    form, as SGLang's get_data_page gives it) rather than in parts. ``pool_name``: SGLang's
    pool the pages belong to; a pool other than KV (the draft model's) is named, so its
    store never passes for the KV pool's even when the geometry is the same.
    """
    geometry = ";".join(f"{name}={value}" for name, value in pool.geometry)
    model = (
        f"sglang:{shard.model_name}|{pool.pool_class};layout={pool.layout};{geometry};"
        f"{shard.parallel_facts()};parts={parts};staged={int(staged)}"
    )
    if pool_name != "kv":
        model += f";pool={pool_name}"
    return LayoutFingerprint(
        model=model,
        dtype=pool.dtype,
        tokens_per_block=pool.page_size,
        page_bytes=(block_bytes * parts,),
        rank=0,
        world_size=1,
        block_bytes=block_bytes,
    )


def page_key(key: str, shard: int, part: int) -> OffloadKey:
    """The kvtier key of ``part`` of this rank's ``shard`` of the page SGLang names ``key``.

    SGLang's page keys are 64 hex digits (a SHA-256 chained over the prefix), kept as their
    32 bytes so a key on disk reads as SGLang logged it; any other string (a custom hash, a
    sidecar pool's suffixed name) is hashed to 32 bytes.
    """
    if not isinstance(key, str):
        raise TypeError(f"an SGLang page key is a str, got {type(key).__name__}")
    if not 0 <= part < _MAX_PARTS:
        raise ValueError(f"part {part} outside 0..{_MAX_PARTS - 1}")
    digest = (
        bytes.fromhex(key) if _HEX_KEY.fullmatch(key) else hashlib.sha256(b"sglang:" + key.encode()).digest()
    )
    return make_offload_key(digest, shard * _MAX_PARTS + part)


def check_pool_name(name: str) -> None:
    """:class:`ConfigError` unless kvtier stores SGLang's pool ``name`` (KV, or an extra pool)."""
    if name == "kv" or name in EXTRA_POOLS:
        return
    raise ConfigError(
        "hicache host pool",
        name,
        "a pool kvtier stores: " + ", ".join(("kv", *EXTRA_POOLS)),
        "kvtier does not store Mamba or SWA states (a window of trailing pages, in host slots "
        "of their own) nor indexer or compressed pools (DeepSeek sparse attention); serve this "
        "model with SGLang's file backend (--hicache-storage-backend file), or without an L3 backend",
    )


def pool_tiers(
    settings: SGLangSettings, pages: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[TierConfig, ...]]:
    """The lower tiers holding each pool's pages: ``pages`` maps SGLang's pool names, KV first,
    to each pool's ``(block_bytes, blocks per page)``.

    The KV pool's are the configured tiers. A store serves one layout, so an extra pool's are
    stores of their own beside them: named ``<tier>-<pool>``, in the directory ``<path>/<pool>``
    (disk tiers) or the namespace ``<namespace>:<pool>`` (a Valkey namespace derived from the
    layout differs already). A tier's capacity is shared by its pools' stores in proportion to
    their pages' size on disk, so each holds as many pages and together they hold at most the
    capacity; the shares depend on the pools alone, so a restart with the same pools reopens
    the same stores whole. A tier kind with neither a path nor a namespace cannot keep a second
    store apart: :class:`ConfigError`.
    """
    on_disk = {name: parts * on_disk_block_bytes(block) for name, (block, parts) in pages.items()}
    total = sum(on_disk.values())
    stores: dict[str, tuple[TierConfig, ...]] = {}
    for pool_name, page_bytes in on_disk.items():
        tiers = []
        for index, tier in enumerate(settings.lower_tiers, start=1):
            changes: dict[str, Any] = {"capacity_bytes": tier.capacity_bytes * page_bytes // total}
            if pool_name != "kv":
                changes.update(_beside(settings, index, tier, pool_name))
            tiers.append(dataclasses.replace(tier, **changes))
        stores[pool_name] = tuple(tiers)
    return stores


def _beside(settings: SGLangSettings, index: int, tier: TierConfig, pool_name: str) -> dict[str, Any]:
    """Where the extra pool ``pool_name`` keeps its store of ``settings.config.tiers[index]``."""
    own = {f.name: getattr(tier, f.name) for f in dataclasses.fields(tier)}
    if own.get("path"):
        return {"name": f"{tier.name}-{pool_name}", "path": os.path.join(own["path"], pool_name)}
    if "namespace" in own:
        namespace = f"{own['namespace']}:{pool_name}" if own["namespace"] else None
        return {"name": f"{tier.name}-{pool_name}", "namespace": namespace}
    raise ConfigError(
        f"{settings.tier_field(index)}.kind",
        tier.kind,
        f"a tier with a path or a namespace, to keep SGLang's {pool_name} pool in a store "
        "beside the KV pool's",
        "use lmdb, files or valkey tiers with speculative decoding",
    )

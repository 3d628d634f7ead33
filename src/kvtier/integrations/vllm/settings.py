"""From vLLM's ``OffloadingConfig`` to kvtier's configuration, layout and fingerprint.

vLLM hands an offloading spec one :class:`vllm.v1.kv_offload.config.OffloadingConfig` per
process (the scheduler's and each worker's differ only in ``parallel.rank``). Everything
kvtier needs is derived from it here, once, by pure functions, so that the scheduler process
and every worker process reach the same answers without talking to each other:

* which keys of ``kv_connector_extra_config`` are kvtier's (the rest belong to vLLM's
  connector, or are settings of vLLM's own CPU spec that would be silently ignored here);
* the tokens and bytes of one offloaded block (vLLM calls it a chunk: ``blocks_per_chunk``
  GPU blocks), which fix the CPU tier's row size: one row holds every worker's shard of the
  chunk, side by side in rank order, or a single copy when vLLM says the workers' KV is
  identical (``replicated_layout``: MLA under tensor parallelism), as vLLM's own CPU tier
  lays out its shared rows;
* the path of the CPU tier's shared region, which workers attach to by name;
* the :class:`~kvtier.tiers.disk.format.LayoutFingerprint` stamped on every block written to disk,
  so that a changed model, dtype or layout never reads old blocks.

Everything here is bookkeeping on small values: any process, any thread, never blocks.
Mistakes raise :class:`~kvtier.errors.ConfigError` naming the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import CONFIG_ENV, KvtierConfig, env_config_path, load_config
from kvtier.config.parse import TOP_KEYS
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.tiers.cpu.region import default_directory
from kvtier.worker.shards import ShardPlacement

__all__ = [
    "CONNECTOR_KEYS",
    "COPY_ENGINE_KEY",
    "CPU_SPEC_KEYS",
    "INTEGRATION_KEYS",
    "FullStackLayout",
    "is_replicated",
    "kv_replicas",
    "kvtier_settings",
    "layout_fingerprint",
    "num_shards",
    "resolve_full_stack",
]

#: keys of kv_connector_extra_config that vLLM's offloading connector reads for any spec; they
#: configure the connector, not kvtier, so kvtier's parser never sees them
CONNECTOR_KEYS = (
    "self_describing_kv_events",
    "blocks_per_chunk",
    "sync_load_budget_bytes",
    "canonical_layout",
    "enable_telemetry",
)
#: settings of vLLM's own CPUOffloadingSpec / TieringOffloadingSpec, with what replaces each in
#: kvtier: accepting them would let a setting look effective while nothing reads it
CPU_SPEC_KEYS = {
    "cpu_bytes_to_use": "give the CPU tier's size as tiers[0].capacity, e.g. "
    "tiers: [{kind: cpu, capacity: 64GiB}]",
    "eviction_policy": "give the CPU tier's policy as tiers[0].eviction (lru or arc)",
    "cache_policy_module_path": "give an out-of-tree policy as tiers[0].eviction_module_path",
    "store_threshold": "kvtier stores every offered block; remove the key",
    "max_tracker_size": "kvtier stores every offered block; remove the key",
    "secondary_tiers": "list kvtier's disk tiers under tiers: after the cpu tier, or select "
    "spec_name TieringOffloadingSpec to use vLLM's tiering with KvtierDiskTier",
    "tier_poll_interval_s": "kvtier polls its tiers at every lookup and step end; remove the key",
    "backpressure": "kvtier bounds disk I/O per step with cascade.max_demote_bytes_per_step; remove the key",
}
#: keys the integration itself reads (not kvtier's stack configuration)
STATS_LOG_INTERVAL_KEY = "kvtier_stats_log_interval_s"
#: the workers' copy engine (``kvtier.worker.engines``): DMA by default, or the Triton kernel
COPY_ENGINE_KEY = "kvtier_copy_engine"
COPY_ENGINES = ("auto", "cuda", "kernel")
INTEGRATION_KEYS = (STATS_LOG_INTERVAL_KEY, COPY_ENGINE_KEY)
#: seconds between two INFO lines of tier statistics in vLLM's log (0: never)
DEFAULT_STATS_LOG_INTERVAL_S = 60.0

# Characters allowed in the CPU region's file name; anything else in an engine id becomes '_'.
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME_CHARS = 120


def kvtier_settings(extra_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``kv_connector_extra_config`` into (kvtier's keys, the integration's keys).

    Connector keys are dropped (vLLM reads them itself); a key of vLLM's own CPU spec, or
    ``canonical_layout: true`` (a host layout kvtier's rows do not implement), raises
    :class:`ConfigError`. What remains goes to :func:`kvtier.load_config`, whose own checks
    catch misspelt keys. With neither ``kvtier_config`` nor inline kvtier keys, the YAML that
    ``KVTIER_CONFIG`` names in the engine's environment is the stack (every process of the
    engine inherits it, so all reach the same one); without that either, :class:`ConfigError`.
    """
    if not isinstance(extra_config, Mapping):
        raise ConfigError(
            "kv_connector_extra_config",
            extra_config,
            "a mapping of settings",
            'write it as a JSON object, e.g. {"spec_name": "TieredOffloadingSpec", ...}',
        )
    kvtier: dict[str, Any] = {}
    integration: dict[str, Any] = {}
    for key, value in extra_config.items():
        if key in CPU_SPEC_KEYS:
            raise ConfigError(
                f"kv_connector_extra_config.{key}",
                value,
                "kvtier's settings (a setting of vLLM's CPUOffloadingSpec does nothing here)",
                CPU_SPEC_KEYS[key],
            )
        if key == "canonical_layout" and value:
            raise ConfigError(
                "kv_connector_extra_config.canonical_layout",
                value,
                "false or absent: kvtier's CPU rows hold the worker's pages as they are",
                "remove canonical_layout, or use vLLM's TieringOffloadingSpec with "
                "KvtierDiskTier, which stores whatever rows vLLM's CPU tier holds",
            )
        if key in CONNECTOR_KEYS:
            continue
        if key in INTEGRATION_KEYS:
            integration[key] = value
        else:
            kvtier[key] = value
    if "kvtier_config" not in kvtier and not any(key in kvtier for key in TOP_KEYS):
        path = env_config_path()
        if path is None:
            raise ConfigError(
                "kv_connector_extra_config.kvtier_config",
                None,
                f"kvtier's tier stack: a YAML path, inline tiers, or {CONFIG_ENV} in vLLM's environment",
                'add "kvtier_config": "tiers.yaml" (see examples/vllm/tiers.yaml), or '
                f"export {CONFIG_ENV}=/path/to/tiers.yaml before vllm serve",
            )
        kvtier["kvtier_config"] = path
    return kvtier, integration


def _layout_facts(config: Any) -> str:
    """What, beyond the fields of LayoutFingerprint, decides the meaning of a row's bytes.

    The byte order inside a page (vLLM's kv_cache_layout, NHD or HND), which layers each group
    holds, the parallel layout that splits heads and layers across workers, and vLLM's host
    layouts (replicated or canonical rows). LayoutFingerprint has no fields for them, so they
    ride in its ``model`` string, whose digest every block header carries.
    """
    parallel = config.parallel
    groups = ",".join(
        f"{group.group_id}:{len(group.layer_names)}x{group.tokens_per_block}" for group in config.groups
    )
    if is_replicated(config):
        # Every worker holds the same bytes, whatever their number: TP=2 and TP=4 engines
        # share blocks (vLLM's fs tier drops the parallel sizes for this layout as well).
        parallel_facts = "tp=1;pp=1;pcp=1;dcp=1;replicated=1"
    else:
        parallel_facts = (
            f"tp={parallel.tp_size};pp={parallel.pp_size};pcp={parallel.pcp_size};"
            f"dcp={parallel.dcp_size};replicated=0"
        )
    return (
        f"kv_cache_layout={config.kv_cache_layout};groups={groups};{parallel_facts};"
        f"canonical={int(bool(config.canonical_layout))};shards={num_shards(config)}"
    )


def is_replicated(config: Any) -> bool:
    """Whether every worker's KV is byte-identical (vLLM's replicated layout: MLA under tensor
    parallelism), so a row means the same whatever the world size."""
    return bool(config.replicated_layout) and num_shards(config) == 1


def kv_replicas(config: Any) -> int:
    """How many consecutive workers hold identical KV: all of them when vLLM says the layout
    is replicated (it does so only for MLA with tensor parallelism alone), else 1."""
    return int(config.parallel.world_size) if config.replicated_layout else 1


def num_shards(config: Any) -> int:
    """Distinct worker shards in one row of the CPU tier."""
    return int(config.parallel.world_size) // kv_replicas(config)


def layout_fingerprint(config: Any, block_bytes: int) -> LayoutFingerprint:
    """The fingerprint of rows of ``block_bytes`` laid out as ``config`` (an OffloadingConfig) says.

    ``rank`` is 0 and ``world_size`` vLLM's: a row holds every worker's shard of the block
    (how many distinct shards is in the ``model`` string with the parallel layout). A
    replicated layout has one shard that every worker holds alike: its fingerprint names no
    world size (1) nor parallel sizes, so engines of any TP size share its blocks.
    ``page_bytes`` is the one per-block size vLLM's config states (a worker's bytes per GPU
    block, all groups together), since the scheduler process never sees the per-group pages.
    """
    chunk = config.cache.blocks_per_chunk
    return LayoutFingerprint(
        model=f"{config.model.name}|{_layout_facts(config)}",
        dtype=str(config.model.dtype),
        tokens_per_block=config.groups[0].tokens_per_block * chunk if config.groups else 0,
        page_bytes=(int(config.worker_kv_bytes_per_block),),
        rank=0,
        world_size=1 if is_replicated(config) else int(config.parallel.world_size),
        block_bytes=int(block_bytes),
    )


@dataclass(frozen=True)
class FullStackLayout:
    """What both sides of :class:`~kvtier.integrations.vllm.TieredOffloadingSpec` agree on."""

    #: the kvtier stack, with block_size_tokens set to vLLM's chunk and the CPU region's path
    config: KvtierConfig
    #: tokens per GPU block (every offloaded group has the same)
    gpu_block_size_tokens: int
    #: GPU blocks per offloaded block (vLLM's blocks_per_chunk)
    block_size_factor: int
    #: bytes of one CPU row: every distinct worker shard of a chunk
    block_bytes: int
    #: this worker's shard: where in the row it copies, and whether its stores write
    shard: ShardPlacement
    #: what the disk tiers stamp on every block
    fingerprint: LayoutFingerprint
    #: where the CPU tier's shared region lives: its path (``tiers[0].path`` given), or the
    #: stem both sides derive (``region_suffixed``)
    region_path: str
    #: seconds between two INFO lines of statistics (0: never)
    stats_log_interval_s: float
    #: the workers' copy engine: auto (batched DMA on CUDA), cuda, or kernel (Triton)
    copy_engine: str = "auto"
    #: the scheduler creates the region at ``region_path`` plus a random suffix
    #: (:func:`~kvtier.tiers.cpu.region.unique_region_path`), and the workers find it
    #: (:func:`~kvtier.tiers.cpu.region.find_region`): a name derived from the engine id alone
    #: could be taken first by another local user, and the engine would not start
    region_suffixed: bool = False


def _region_path(cpu: CPUTierConfig, config: Any) -> str:
    """The CPU region's path (or stem), the same in the scheduler and in every worker of one
    engine.

    Derived from vLLM's ``engine_id`` (unique per engine, and per data-parallel replica), not
    drawn at random as the standalone spec does: each process builds its own spec object, so
    a random name would differ between the process that creates the region and those that
    attach to it. It is a stem: the region gets a random suffix the workers look up (see
    ``FullStackLayout.region_suffixed``). An explicit ``tiers[0].path`` is taken as given,
    suffixed with the replica index when there are several data-parallel replicas (each has
    its own region); it belongs in a folder only the engine's user may write.
    """
    parallel = config.parallel
    if cpu.path is not None:
        if parallel.data_parallel_size > 1:
            return f"{cpu.path}-dp{parallel.data_parallel_index}"
        return cpu.path
    name = _UNSAFE_NAME_CHARS.sub("_", str(config.engine_id))[:_MAX_NAME_CHARS]
    return os.path.join(default_directory(), f"kvtier-{name}")


def _stats_interval(integration: Mapping[str, Any]) -> float:
    value = integration.get(STATS_LOG_INTERVAL_KEY, DEFAULT_STATS_LOG_INTERVAL_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(
            f"kv_connector_extra_config.{STATS_LOG_INTERVAL_KEY}",
            value,
            "a number of seconds >= 0 (0: never log statistics)",
            f"write e.g. {DEFAULT_STATS_LOG_INTERVAL_S:g}",
        )
    return float(value)


def _copy_engine(integration: Mapping[str, Any]) -> str:
    value = integration.get(COPY_ENGINE_KEY, "auto")
    if value not in COPY_ENGINES:
        raise ConfigError(
            f"kv_connector_extra_config.{COPY_ENGINE_KEY}",
            value,
            "one of " + ", ".join(COPY_ENGINES),
            "auto (batched DMA) unless kvtier bench transfer --device cuda shows the kernel "
            "faster for your pages",
        )
    return value


def resolve_full_stack(config: Any) -> FullStackLayout:
    """Parse the kvtier settings in ``config.extra_config`` against vLLM's layout.

    Raises :class:`ConfigError` for anything kvtier cannot serve as configured: a bad kvtier
    setting, a ``block_size_tokens`` that disagrees with the chunk vLLM offloads, or no KV
    bytes to offload. Any tensor, pipeline and context parallel layout is served: each
    worker (``config.parallel.rank``) copies its own shard of every row.
    """
    kvtier_keys, integration_keys = kvtier_settings(config.extra_config)
    parsed = load_config(kvtier_keys)

    if not config.groups:
        raise ConfigError("groups", (), "at least one KV cache group to offload")
    tokens = {group.tokens_per_block for group in config.groups}
    chunk = int(config.cache.blocks_per_chunk)
    gpu_block = min(tokens)
    if len(tokens) > 1:
        # Rows are cut in block_size_factor GPU blocks whatever the group, which vLLM's
        # blocks_per_chunk also is; kvtier's block_size_tokens cannot say it for mixed sizes.
        if parsed.block_size_tokens is not None:
            raise ConfigError(
                "block_size_tokens",
                parsed.block_size_tokens,
                f"absent: the KV groups have different block sizes ({sorted(tokens)} tokens)",
                'give "blocks_per_chunk" in kv_connector_extra_config instead',
            )
        chunk_tokens = None
    else:
        chunk_tokens = gpu_block * chunk
        if parsed.block_size_tokens is not None and parsed.block_size_tokens != chunk_tokens:
            raise ConfigError(
                "block_size_tokens",
                parsed.block_size_tokens,
                f"{chunk_tokens}: the tokens vLLM offloads per block (GPU block of {gpu_block} "
                f"tokens x blocks_per_chunk {chunk}); vLLM reads the chunk size only from "
                "kv_connector_extra_config",
                f'put "block_size": {parsed.block_size_tokens} in kv_connector_extra_config '
                "(and drop block_size_tokens from the kvtier YAML)",
            )
    bytes_per_gpu_block = int(config.worker_kv_bytes_per_block)
    if bytes_per_gpu_block <= 0:
        raise ConfigError(
            "worker_kv_bytes_per_block",
            bytes_per_gpu_block,
            "the bytes of one GPU block (> 0) as vLLM sized the KV cache",
            "this KV cache layout has no per-block bytes to offload; kvtier cannot serve it",
        )

    cpu = parsed.tiers[0]
    assert isinstance(cpu, CPUTierConfig)  # load_config guarantees tiers[0] is the cpu tier
    cpu_path_given = cpu.path
    region_path = _region_path(cpu, config)
    cpu = dataclasses.replace(cpu, path=region_path)
    # With mixed group sizes the factor is vLLM's blocks_per_chunk directly: express it as
    # block_size_tokens over the smallest block, which the standalone spec divides back.
    resolved = dataclasses.replace(
        parsed,
        tiers=(cpu, *parsed.tiers[1:]),
        block_size_tokens=chunk_tokens if chunk_tokens is not None else gpu_block * chunk,
    )
    # vLLM sizes every worker's KV cache alike (the scheduler knows only this one figure), so
    # every shard has the same bytes; a worker whose pages differ is refused at get_worker.
    shard = ShardPlacement(
        world_size=int(config.parallel.world_size),
        rank=int(config.parallel.rank),
        shard_bytes=chunk * bytes_per_gpu_block,
        kv_replicas=kv_replicas(config),
    )
    block_bytes = shard.row_bytes
    return FullStackLayout(
        config=resolved,
        gpu_block_size_tokens=gpu_block,
        block_size_factor=chunk,
        block_bytes=block_bytes,
        shard=shard,
        fingerprint=layout_fingerprint(config, block_bytes),
        region_path=region_path,
        stats_log_interval_s=_stats_interval(integration_keys),
        copy_engine=_copy_engine(integration_keys),
        region_suffixed=cpu_path_given is None,
    )

"""``TieredOffloadingSpec``: kvtier's whole stack as vLLM 0.33's offloading spec.

Selected from settings alone::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm", "kvtier_config": "tiers.yaml"}}'

vLLM's ``OffloadingSpecFactory`` imports ``spec_module_path`` and takes ``spec_name`` from it,
then builds the spec from an ``OffloadingConfig`` in the scheduler process (which calls
:meth:`TieredOffloadingSpec.get_manager`) and in each worker process (which calls
:meth:`TieredOffloadingSpec.get_worker`). The kvtier settings are ``kvtier_config: PATH`` or
inline kvtier keys (``tiers``, ``cascade``) beside vLLM's; :mod:`.settings` derives the rest
(chunk size, row bytes, region path, layout fingerprint) from vLLM's configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    ConfigInfo,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.build import build_manager
from kvtier.config import format_size
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.manager import STATS_METRIC, KvtierOffloadingManager
from kvtier.integrations.vllm.settings import FullStackLayout, resolve_full_stack
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker, to_kvtier_caches
from kvtier.spec import TieredOffloadingSpec as StandaloneSpec
from kvtier.tiers.cpu.backend import CPUBackend
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.tiers.cpu.region import find_region, unique_region_path
from kvtier.worker.failures import FailedRowMarks

__all__ = ["KvtierStackInfo", "TieredOffloadingSpec"]


@dataclasses.dataclass(frozen=True)
class KvtierStackInfo(ConfigInfo):
    """Labels of ``vllm:kv_offload_config_info`` for kvtier's stack (fixed for the process)."""

    # the tiers, fastest first, as name:kind:capacity
    kvtier_tiers: str
    # bytes of one offloaded block (one CPU row)
    kvtier_block_bytes: int
    # tokens one offloaded block spans
    kvtier_block_size_tokens: int
    # cascade write policy (write_back or write_through)
    kvtier_write_policy: str


def _describe_tiers(layout: FullStackLayout) -> str:
    return ",".join(
        f"{tier.name}:{tier.kind}:{format_size(tier.capacity_bytes).replace(' ', '')}"
        for tier in layout.config.tiers
    )


class TieredOffloadingSpec(OffloadingSpec):
    """vLLM's OffloadingSpec for kvtier's tier stack (a CPU tier, then optional disk tiers).

    Who calls it: vLLM, once per process: constructed from the engine's ``OffloadingConfig``
    (raises :class:`~kvtier.errors.ConfigError` for bad kvtier settings or a layout kvtier
    cannot serve); :meth:`get_manager` in the scheduler
    process (creates the CPU region, opens the disk tiers: blocks for their index scan);
    :meth:`get_worker` in each worker process (never waits for the region; see
    :mod:`kvtier.integrations.vllm.worker`).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        from kvtier.integrations.vllm.metrics import metric_definitions

        return {
            **metric_definitions(),  # kvtier's own names (docs/reference/metrics.md)
            STATS_METRIC: OffloadingGaugeMetadata(
                documentation=(
                    "kvtier's statistics (manager.stats()), one series per figure: CPU-tier "
                    "block counts and, per disk tier, blocks, promotions, demotions, bytes, "
                    "failures and corrupt blocks dropped; totals since start."
                ),
                labelnames=("stat",),
            ),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return KvtierStackInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        #: kvtier's configuration and layout, derived from ``config``
        self.layout = resolve_full_stack(config)
        # vLLM's connector reads this: with it, only the writing rank submits a store of a
        # replicated (MLA) cache and the others acknowledge the job at once, which is what
        # kvtier's one-copy rows need (its non-writing handlers would copy nothing anyway).
        self.replicated_layout = bool(config.replicated_layout)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """The manager (scheduler process; built on the first call, the same object after)."""
        if self._manager is None:
            layout = self.layout
            # The scheduler never copies to or from the GPU, and pinning is per process:
            # each worker pins its own mapping of the region.
            first = layout.config.tiers[0]
            assert isinstance(first, CPUTierConfig)  # resolve_full_stack checked it
            region_path = (
                unique_region_path(layout.region_path) if layout.region_suffixed else layout.region_path
            )
            cpu = dataclasses.replace(first, path=region_path, pin_memory="off")
            config = dataclasses.replace(layout.config, tiers=(cpu, *layout.config.tiers[1:]))
            events = self.kv_events_config.enable_kv_cache_events
            inner = build_manager(
                config, layout.block_bytes, enable_events=events, fingerprint=layout.fingerprint
            )
            info = KvtierStackInfo(
                kvtier_tiers=_describe_tiers(layout),
                kvtier_block_bytes=layout.block_bytes,
                kvtier_block_size_tokens=layout.config.block_size_tokens or 0,
                kvtier_write_policy=layout.config.cascade.write_policy,
            )
            backend = inner.backend
            assert isinstance(backend, CPUBackend)  # what the cpu tier opens
            try:
                failed_rows = FailedRowMarks.create(region_path, backend.num_blocks)
            except BaseException:
                inner.shutdown()
                raise
            self._manager = KvtierOffloadingManager(
                inner,
                events=events,
                config_info=info.as_config_info(),
                stats_log_interval_s=layout.stats_log_interval_s,
                failed_rows=failed_rows,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker's handlers (worker process; built on the first call).

        Raises :class:`ConfigError` if the worker's KV pages do not add up to the shard size
        the scheduler side derived from vLLM's configuration (the CPU rows would not fit).
        """
        if self._worker is None:
            layout = self.layout
            caches = to_kvtier_caches(kv_caches)
            pages = [entry.page_size_bytes for entry in caches.tensors]
            shard_bytes = layout.block_size_factor * sum(pages)
            if shard_bytes != layout.shard.shard_bytes:
                raise ConfigError(
                    "kv_caches",
                    f"{len(pages)} tensors of {sum(pages)} bytes per GPU block",
                    f"pages adding up to vLLM's worker_kv_bytes_per_block "
                    f"({layout.shard.shard_bytes // layout.block_size_factor} bytes), which "
                    f"sized this worker's shard of the CPU rows",
                    "this model's KV cache has bytes per block that the offloaded groups do "
                    "not cover (e.g. a group that is not offloaded); kvtier's spec does not "
                    "support it yet: use vLLM's TieringOffloadingSpec with KvtierDiskTier",
                )
            standalone = StandaloneSpec(
                layout.config,
                gpu_block_size_tokens=layout.gpu_block_size_tokens,
                page_bytes=pages,
                enable_events=False,
                world_size=layout.shard.world_size,
                rank=layout.shard.rank,
                kv_replicas=layout.shard.kv_replicas,
                engine=layout.copy_engine,
            )
            stem = layout.region_path
            self._worker = KvtierOffloadingWorker(
                standalone,
                caches,
                find_region=(lambda: find_region(stem)) if layout.region_suffixed else None,
            )
        return self._worker

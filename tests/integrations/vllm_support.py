"""What the vLLM integration tests share: vLLM configs, a stand-in GPU cache, disk surgery.

Imported only by modules that skipped already when vLLM is missing.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.tiers.disk.format import HEADER_BYTES

SPEC_MODULE = "kvtier.integrations.vllm"
TOKENS_PER_BLOCK = 16
#: bytes of one GPU block per layer (K and V together) in the stand-in cache
PAGE_BYTES = 4096
NUM_LAYERS = 2
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(
    extra_config: dict,
    *,
    blocks_per_chunk: int = 1,
    model: str = "test-org/tiny-model",
    dtype: str = "bfloat16",
    kv_cache_layout: str = "NHD",
    world_size: int = 1,
    rank: int = 0,
    events: bool = True,
    engine_id: str | None = None,
    bytes_per_block: int = NUM_LAYERS * PAGE_BYTES,
) -> OffloadingConfig:
    """The OffloadingConfig vLLM 0.33 would build for a one-group model of NUM_LAYERS layers."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=TOKENS_PER_BLOCK,
                layer_names=tuple(f"model.layers.{i}.attn" for i in range(NUM_LAYERS)),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id or f"test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        kv_cache_layout=kv_cache_layout,
    )


def kvtier_extra(tiers: list[dict], **extra) -> dict:
    """kv_connector_extra_config selecting kvtier's spec with inline tiers."""
    return {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": tiers,
        **extra,
    }


def tiering_extra(tier: dict, cpu_bytes: int = 1 << 20, **extra) -> dict:
    """kv_connector_extra_config selecting vLLM's tiering with one KvtierDiskTier."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [{"type": "KvtierDiskTier", "module_path": SPEC_MODULE, **tier}],
        **extra,
    }


def key(i: int, group: int = 0) -> bytes:
    """A distinct offload key (a 32-byte block hash and a group index)."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), group)


def payload(k: bytes, nbytes: int) -> np.ndarray:
    """The bytes that belong to key ``k``: derived from the key, so any copy can be checked."""
    seed = int.from_bytes(hashlib.sha256(k).digest()[:8], "big")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class StandInGPU:
    """CPU tensors standing in for the engine's KV cache: NUM_LAYERS of (num_blocks, PAGE_BYTES)."""

    def __init__(self, num_blocks: int):
        self.layers = [torch.zeros((num_blocks, PAGE_BYTES), dtype=torch.int8) for _ in range(NUM_LAYERS)]

    def canonical(self) -> CanonicalKVCaches:
        """The caches as vLLM's connector worker hands them to ``spec.get_worker``."""
        return CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, PAGE_BYTES) for t in self.layers],
            group_data_refs=[[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(NUM_LAYERS)]],
        )

    def write_chunk(self, block_ids: Sequence[int], k: bytes) -> None:
        """Fill GPU blocks ``block_ids`` (one chunk) with ``k``'s bytes."""
        data = payload(k, len(block_ids) * NUM_LAYERS * PAGE_BYTES).view(np.int8)
        data = data.reshape(NUM_LAYERS, len(block_ids), PAGE_BYTES)
        for layer, rows in zip(self.layers, data):
            layer[list(block_ids)] = torch.from_numpy(rows.copy())

    def read_chunk(self, block_ids: Sequence[int]) -> np.ndarray:
        """The bytes of GPU blocks ``block_ids``, in write_chunk's order."""
        parts = [layer[list(block_ids)].numpy().view(np.uint8) for layer in self.layers]
        return np.stack(parts).reshape(-1)

    def scribble(self, block_ids: Sequence[int]) -> None:
        for layer in self.layers:
            layer[list(block_ids)] = 0x55


def run_steps_until(manager: OffloadingManager, keys, ctx: ReqContext, max_steps: int = 200) -> list:
    """Look ``keys`` up once per step, as the connector does for a deferred request, until no
    answer is pending (HIT_PENDING / RETRY); the final answers."""
    for _ in range(max_steps):
        answers = [manager.lookup(k, ctx) for k in keys]
        if not any(a in (LookupResult.HIT_PENDING, LookupResult.RETRY) for a in answers):
            return answers
        manager.on_schedule_end(STEP_END)
        drain_disk(manager)
    raise AssertionError(f"lookups still pending after {max_steps} steps: {answers}")


def drain_disk(manager: OffloadingManager) -> None:
    """Wait for the disk I/O in flight (a test's stand-in for time passing between steps)."""
    inner = getattr(manager, "inner", None)
    tiers = getattr(inner, "tiers", None) if inner is not None else None
    if tiers is None:
        tiers = [tier.tier for tier in getattr(manager, "secondary_tiers", [])]
    for tier in tiers:
        tier.drain_jobs()


def corrupt_block(path: str, block_bytes: int, k: bytes) -> None:
    """Flip one payload byte of ``k``'s block on disk, as a bad sector would."""
    from kvtier.tiers.disk.scan import find_blocks

    for file, offset, found in find_blocks(path, block_bytes):
        if found == k:
            with open(file, "r+b") as stream:
                stream.seek(offset + HEADER_BYTES + block_bytes // 2)
                byte = stream.read(1)
                stream.seek(offset + HEADER_BYTES + block_bytes // 2)
                stream.write(bytes([byte[0] ^ 0xFF]))
            return
    raise AssertionError(f"no block of key {k.hex()} under {path}")


def prometheus(extra_config: dict):
    """vLLM's Prometheus sink for offloading stats, on a registry of its own: ``(sink, registry)``.

    ``sink.observe(stats.data)`` is what vLLM's stat loggers do with every stats payload.
    """
    import functools
    from types import SimpleNamespace

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    registry = prometheus_client.CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Gauge,
            prometheus_client.Counter,
            prometheus_client.Histogram,
        )
    }
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config))
    sink = OffloadPromMetrics(config, types, ["engine"], {0: ["0"]})
    return sink, registry

"""``TieredOffloadingSpec``: one configuration, both sides of the offloading stack.

The scheduler process calls :meth:`TieredOffloadingSpec.get_manager` and gets the configured
manager, whose CPU tier creates a shared-memory region; every worker process calls
:meth:`TieredOffloadingSpec.get_handlers` with the engine's KV cache, attaches to that region
by path, pins it for DMA and gets the two CPU<->GPU handlers. Both sides derive the same
geometry from the same configuration and page sizes, so they agree on the row layout
(:mod:`kvtier.worker.blocks`).

Tensor and pipeline parallelism: one worker process per rank, each constructing the spec with
the same arguments and its own ``rank``. A CPU row holds every rank's shard of its block
(:mod:`kvtier.worker.shards`), so the manager stays rank-agnostic (one key, one row) and a
disk tier writes the whole row as one block, under a layout fingerprint that names the world
size and shard layout. Every rank answers every job; the job is done when all have, and
failed if any failed: :class:`kvtier.worker.RankResultAggregator` combines the per-rank
results before the driver calls ``complete_store`` / ``complete_load``.

This is the standalone form: the engine's layout is given as arguments. The vLLM subclass
(``kvtier.integrations.vllm``) reads the same facts from vLLM's configuration.
Importing this module does not import torch; :meth:`get_handlers` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingHandler,
    OffloadingManager,
    OffloadingSpec,
)
from kvtier.build import build_manager
from kvtier.config import KvtierConfig, load_config, positive_int
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.errors import ConfigError, KvtierError
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.cpu.region import SharedRegion, default_directory
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.worker.shards import ShardPlacement

if TYPE_CHECKING:  # imports torch: only where handlers are built
    from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers

__all__ = ["TieredOffloadingSpec"]

#: how long a worker waits for the scheduler side to create the CPU region
DEFAULT_ATTACH_TIMEOUT_S = 10.0
_ATTACH_POLL_S = 0.05


class TieredOffloadingSpec(OffloadingSpec):
    """Builds the manager (scheduler side) and the CPU<->GPU handlers (worker side).

    ``config``: anything :func:`kvtier.load_config` takes. ``gpu_block_size_tokens``: tokens
    per GPU block of the engine. ``page_bytes[t]``: bytes per block of the engine's canonical
    KV tensor ``t`` (the order of ``CanonicalKVCaches.tensors``), for this worker.

    ``world_size`` / ``rank``: the engine's workers and this one (every worker has the same
    ``page_bytes``); ``kv_replicas``: how many consecutive ranks hold identical KV (an MLA
    cache under tensor parallelism: the TP size), stored once and read by each of them.

    Derived: ``block_size_factor`` (GPU blocks per offloaded block: ``block_size_tokens //
    gpu_block_size_tokens``, 1 when ``block_size_tokens`` is not set), ``shard`` (this
    worker's :class:`~kvtier.worker.shards.ShardPlacement`) and ``block_bytes`` (one CPU row:
    ``world_size / kv_replicas`` shards of ``factor * sum(page_bytes)``). If the CPU tier has
    no ``path``, the spec picks ``<shm dir>/kvtier-<uuid>``; with several workers, give the
    path (each process builds its own spec, and a random name would differ between them).

    Who calls it: constructed in each process from the same arguments; :meth:`get_manager`
    in the scheduler process, :meth:`get_handlers` in each worker process. Neither blocks
    on I/O, except that :meth:`get_handlers` waits up to ``attach_timeout_s`` for the region
    to appear and then while pinning it.
    """

    def __init__(
        self,
        config: KvtierConfig | dict | str | os.PathLike,
        *,
        gpu_block_size_tokens: int,
        page_bytes: Sequence[int],
        enable_events: bool = True,
        attach_timeout_s: float = DEFAULT_ATTACH_TIMEOUT_S,
        engine: str = "auto",
        world_size: int = 1,
        rank: int = 0,
        kv_replicas: int = 1,
        kv_dtype: str = "uint8",
    ):
        """``engine``: the handlers' copy engine, ``auto`` (CUDA tensors: ``cuda``, CPU
        tensors: ``thread``), ``cuda``, ``kernel`` (CUDA, copies by a Triton kernel) or
        ``thread``. ``kv_dtype``: the element dtype of the KV bytes (``bfloat16`` ...), which
        the layout fingerprint carries and lossy codecs need; ``uint8`` (the default) says
        nothing of them. Raises :class:`ConfigError` for inconsistent arguments."""
        config = load_config(config)
        gpu_block = positive_int(gpu_block_size_tokens, "gpu_block_size_tokens")
        try:
            listed = None if isinstance(page_bytes, (str, bytes)) else list(page_bytes)
        except TypeError:
            listed = None
        if not listed:
            raise ConfigError(
                "page_bytes", page_bytes, "a non-empty list of bytes per block, one per KV tensor"
            )
        pages = tuple(positive_int(p, f"page_bytes[{i}]") for i, p in enumerate(listed))
        tokens = config.block_size_tokens
        if tokens is None:
            factor = 1
        elif tokens % gpu_block:
            raise ConfigError(
                "block_size_tokens",
                tokens,
                f"a multiple of the engine's GPU block size ({gpu_block} tokens)",
                f"use {max(1, round(tokens / gpu_block)) * gpu_block}",
            )
        else:
            factor = tokens // gpu_block
        shard = ShardPlacement(
            world_size=world_size,
            rank=rank,
            shard_bytes=factor * sum(pages),
            kv_replicas=kv_replicas,
        )
        cpu = config.tiers[0]
        assert isinstance(cpu, CPUTierConfig)  # load_config guarantees tiers[0] is the cpu tier
        if cpu.path is None and shard.world_size > 1:
            raise ConfigError(
                "tiers[0].path",
                None,
                f"the CPU region's path, the same in all {shard.world_size} worker processes",
                "give the cpu tier a path, e.g. /dev/shm/kvtier-<engine id>",
            )
        if cpu.path is None:
            # Workers attach by path, so the path must be known before the region exists; a
            # random name keeps two engines on one host apart.
            cpu = dataclasses.replace(
                cpu, path=os.path.join(default_directory(), f"kvtier-{uuid.uuid4().hex}")
            )
            config = dataclasses.replace(config, tiers=(cpu, *config.tiers[1:]))
        #: the parsed configuration, with the CPU region's path filled in
        self.config = config
        self.gpu_block_size_tokens = gpu_block
        self.page_bytes = pages
        self.block_size_factor = factor
        #: this worker's shard of every row
        self.shard = shard
        self.block_bytes = shard.row_bytes
        #: where the CPU tier's shared region lives
        assert cpu.path is not None  # given, or filled in just above
        self.region_path: str = cpu.path
        self.enable_events = enable_events
        #: the KV bytes' element dtype, as the fingerprint names it
        self.kv_dtype = str(kv_dtype)
        self.attach_timeout_s = float(attach_timeout_s)
        self.engine = engine
        self._manager: OffloadingManager | None = None
        self._handler_sets: list = []

    def get_manager(self) -> OffloadingManager:
        """The configured manager (created on the first call, the same object afterwards).

        Scheduler process. Creates the CPU region at :attr:`region_path`, never pinned here:
        the scheduler side does not copy with the GPU, and pinning is per process (each
        worker pins its own mapping).
        """
        if self._manager is None:
            first = self.config.tiers[0]
            assert isinstance(first, CPUTierConfig)  # checked in __init__
            cpu = dataclasses.replace(first, pin_memory="off")
            config = dataclasses.replace(self.config, tiers=(cpu, *self.config.tiers[1:]))
            self._manager = build_manager(
                config,
                self.block_bytes,
                enable_events=self.enable_events,
                fingerprint=self.fingerprint(),
            )
        return self._manager

    def fingerprint(self) -> LayoutFingerprint:
        """What the disk tiers stamp on every block: the row size, and under parallelism the
        world size and shard layout, so that a store written at TP=2 is never read at TP=4 —
        unless every rank holds the same bytes (``kv_replicas == world_size``), where the row
        is the same at any world size and the fingerprint leaves it out.

        A single worker keeps :meth:`LayoutFingerprint.standalone`, which stores written by
        :func:`kvtier.build_manager` directly also carry.
        """
        shard = self.shard
        if shard.world_size == 1:
            return LayoutFingerprint.standalone(self.block_bytes, self.kv_dtype)
        replicated = shard.num_shards == 1  # every rank holds the same bytes (MLA under TP)
        return LayoutFingerprint(
            # a replicated row means the same whatever the world size: TP=2 and TP=4 share it
            model=f"standalone|replicated;{shard.shard_bytes}"
            if replicated
            else f"standalone|{shard.describe()}",
            dtype=self.kv_dtype,
            tokens_per_block=self.gpu_block_size_tokens * self.block_size_factor,
            page_bytes=self.page_bytes,
            rank=0,  # a row holds every rank's shard
            world_size=1 if replicated else shard.world_size,
            block_bytes=self.block_bytes,
        )

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """``(GPU spec, CPU spec, store handler)`` and ``(CPU spec, GPU spec, load handler)``
        of :meth:`build_handlers`'s handler set."""
        handlers = self.build_handlers(kv_caches)
        yield GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler

    def build_handlers(
        self, kv_caches: CanonicalKVCaches, *, expedited_loads: bool = False
    ) -> CpuGpuOffloadingHandlers:
        """This worker's handler set (:class:`~kvtier.worker.cpu_gpu.CpuGpuOffloadingHandlers`;
        ``expedited_loads``: with a second load handler of its own).

        Worker process. Checks ``kv_caches`` against ``page_bytes`` (:class:`ConfigError` on
        a mismatch), attaches to the region (waiting up to ``attach_timeout_s`` for the
        scheduler side to create it; :class:`KvtierError` after that) and pins it per the CPU
        tier's ``pin_memory``. The handlers own the attached region: it is released once all
        are shut down, or at :meth:`shutdown`.
        """
        actual = [entry.page_size_bytes for entry in kv_caches.tensors]
        if actual != list(self.page_bytes):
            raise ConfigError(
                "page_bytes",
                list(self.page_bytes),
                f"the page sizes of the engine's KV tensors, {actual}",
                "pass page_bytes=[t.page_size_bytes for t in kv_caches.tensors] in every process",
            )
        from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers

        region = self._attach_region()
        first = self.config.tiers[0]
        assert isinstance(first, CPUTierConfig)  # checked in __init__
        try:
            with _on_device_of(kv_caches):
                # registered in the context of the GPU the copies run on, not whichever is
                # current (device 0 by default: a context made there for nothing)
                region.pin(first.pin_memory)
            handlers = CpuGpuOffloadingHandlers(
                kv_caches,
                region,
                self.block_size_factor,
                engine=self.engine,
                owns_region=True,
                shard=self.shard,
                expedited_loads=expedited_loads,
            )
        except BaseException:
            region.close()
            raise
        self._handler_sets.append(handlers)
        return handlers

    def _attach_region(self) -> SharedRegion:
        deadline = time.monotonic() + self.attach_timeout_s
        while True:
            try:
                return SharedRegion.attach(self.region_path)
            except KvtierError as exc:
                # missing, or its creator has not finished the header yet: both resolve soon
                # when the scheduler side is starting; give up at the deadline
                if time.monotonic() >= deadline:
                    raise KvtierError(
                        f"the CPU tier's region {self.region_path} could not be attached within "
                        f"{self.attach_timeout_s:g} s ({exc}); call get_manager() in the scheduler "
                        f"process first, with the same configuration"
                    ) from exc
            time.sleep(_ATTACH_POLL_S)

    def shutdown(self) -> None:
        """Stop the handlers this spec built (waiting for their jobs) and the manager. Idempotent."""
        for handlers in self._handler_sets:
            handlers.shutdown()
        self._handler_sets.clear()
        if self._manager is not None:
            self._manager.shutdown()


def _on_device_of(kv_caches: CanonicalKVCaches) -> contextlib.AbstractContextManager:
    """``torch.cuda.device`` of the caches' first tensor when it is on a GPU, else nothing."""
    device = kv_caches.tensors[0].tensor.device if kv_caches.tensors else None
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)

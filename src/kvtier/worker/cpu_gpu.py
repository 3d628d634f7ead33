"""Handlers moving KV blocks between the engine's GPU cache and the CPU tier, one per direction.

:class:`CpuGpuOffloadingHandlers` is built once per worker process from the engine's
:class:`~kvtier.base.CanonicalKVCaches` and the CPU tier's
:class:`~kvtier.tiers.cpu.region.SharedRegion`; it holds a store handler (GPU to CPU) and a load
handler (CPU to GPU). Each handler checks a job's specs, plans its byte copies with
:class:`~kvtier.worker.blocks.TransferLayout` (whose docstring is the CPU row layout) and
hands them to its copy engine: CUDA streams when the cache is on a GPU, a background thread
when CPU tensors stand in for it. Same API and semantics either way.

Errors: a malformed spec (wrong types or media, counts that do not match the layout, ids out
of range, a block named twice, an unaligned store, a job id still in flight) is a caller bug
and raises ``ValueError`` from :meth:`SingleDirectionOffloadingHandler.transfer_async`;
nothing is queued. A copy that fails once queued is reported by ``get_finished`` as
``TransferResult(success=False)``, logged once, and later jobs go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvtier.base import (
    CanonicalKVCaches,
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)
from kvtier.errors import ConfigError
from kvtier.worker.blocks import TransferLayout
from kvtier.worker.engines import CopyBuffers, CopyEngine, make_engine
from kvtier.worker.shards import ShardPlacement
from kvtier.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.cpu.region import SharedRegion

__all__ = [
    "LOAD_PRIORITY",
    "STORE_PRIORITY",
    "CpuGpuOffloadingHandlers",
    "SingleDirectionOffloadingHandler",
]


#: CUDA stream priorities (lower is more urgent): a load is on a request's critical path,
#: a store is not
LOAD_PRIORITY = -1
STORE_PRIORITY = 0


class SingleDirectionOffloadingHandler(OffloadingHandler):
    """Copies in one direction (GPU->CPU stores or CPU->GPU loads), in submission order.

    Who calls it: the engine's worker, from one thread (the one running the model, whose
    current CUDA stream is the compute stream). :meth:`transfer_async` plans the copies and
    queues them without waiting; :meth:`get_finished` never waits; :meth:`wait` blocks.
    """

    def __init__(
        self,
        layout: TransferLayout,
        engine: CopyEngine,
        *,
        on_shutdown: Callable[[], None] | None = None,
        copies: bool = True,
    ):
        """``on_shutdown`` runs once, after the engine drained (the pair uses it to release
        the region once both directions stopped). ``copies=False``: jobs are checked and
        reported (successful, 0 bytes) in their turn but move nothing; the store handler of
        a worker whose replicated shard another rank writes."""
        self.layout = layout
        self.engine = engine
        self.copies = copies
        #: True for stores (GPU to CPU)
        self.gpu_to_cpu = engine.gpu_to_cpu
        self.src_type: type[BlockIDsLoadStoreSpec]
        self.dst_type: type[BlockIDsLoadStoreSpec]
        if self.gpu_to_cpu:
            self.src_type, self.dst_type = GPULoadStoreSpec, CPULoadStoreSpec
        else:
            self.src_type, self.dst_type = CPULoadStoreSpec, GPULoadStoreSpec
        self._in_flight: set[int] = set()
        self._closed = False
        self._on_shutdown = on_shutdown

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Queue job ``job_id`` copying ``spec = (src, dst)``; ``True`` once queued.

        ``False`` only after :meth:`shutdown`. Raises ``ValueError`` for a malformed spec
        (see the module docstring); nothing is queued then.
        """
        if self._closed:
            return False
        try:
            src, dst = spec
        except (TypeError, ValueError):
            raise ValueError(f"a transfer spec is a (source, destination) pair; got {spec!r}") from None
        # ValueError, not TypeError: every malformed spec is one kind of caller error here
        if not isinstance(src, self.src_type) or not isinstance(dst, self.dst_type):
            raise ValueError(  # noqa: TRY004
                f"this handler copies {self.src_type.__name__} -> {self.dst_type.__name__}; "
                f"got {type(src).__name__} -> {type(dst).__name__}"
            )
        if job_id in self._in_flight:
            raise ValueError(f"job {job_id} is still in flight on this handler")
        gpu_spec, cpu_spec = (src, dst) if self.gpu_to_cpu else (dst, src)
        assert isinstance(gpu_spec, GPULoadStoreSpec)  # src_type and dst_type were checked above
        segments = self.layout.plan(
            gpu_spec.block_ids,
            gpu_spec.group_sizes,
            gpu_spec.block_indices,
            cpu_spec.block_ids,
            gpu_to_cpu=self.gpu_to_cpu,
        )
        if not self.copies:
            # still through the engine, so the job is reported in submission order
            segments = segments.nothing()
        self.engine.submit(job_id, segments)
        self._in_flight.add(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, in submission order; never waits."""
        results = self.engine.get_finished()
        for result in results:
            self._in_flight.discard(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs of this handler have finished; others are ignored.

        Their results are still reported by the next :meth:`get_finished`.
        """
        mine = self._in_flight.intersection(job_ids)
        if mine:
            self.engine.wait(mine)

    def shutdown(self) -> None:
        """Refuse new jobs, wait for the queued ones, release the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown()


def _pages_view(tensor: torch.Tensor, page_bytes: int, index: int) -> torch.Tensor:
    """Tensor ``index`` of the cache as ``(num_blocks, page_bytes)`` int8, sharing its memory.

    Accepts any dtype and shape whose first dimension is the block and whose per-block bytes
    are contiguous; ``view`` (never ``reshape``) so a layout that would need a copy is an
    error instead of a silent copy that transfers would then read and write.
    """
    try:
        pages = tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)
        if pages.dim() != 2 or pages.shape[1] != page_bytes:
            pages = pages.view(pages.shape[0], -1)
    except (RuntimeError, IndexError) as exc:
        pages, reason = None, str(exc)
    else:
        reason = ""
    if pages is None or pages.dim() != 2 or pages.shape[1] != page_bytes:
        raise ConfigError(
            f"kv_caches.tensors[{index}]",
            f"shape {tuple(tensor.shape)}, {tensor.dtype}",
            f"a (num_blocks, {page_bytes}) int8 view, or a tensor with blocks first whose "
            f"{page_bytes} bytes per block are contiguous",
            reason or "check page_size_bytes against the tensor's bytes per block",
        )
    return pages


def _group_copy_bytes(kv_caches: CanonicalKVCaches) -> list[list[int]]:
    """Per group and tensor, how many bytes of each page the group uses (0: not referenced)."""
    num_tensors = len(kv_caches.tensors)
    copy_bytes = []
    for g, refs in enumerate(kv_caches.group_data_refs):
        row = [0] * num_tensors
        for r, ref in enumerate(refs):
            field = f"kv_caches.group_data_refs[{g}][{r}]"
            if not 0 <= ref.tensor_idx < num_tensors:
                raise ConfigError(f"{field}.tensor_idx", ref.tensor_idx, f"an index in [0, {num_tensors})")
            page = kv_caches.tensors[ref.tensor_idx].page_size_bytes
            if not 0 < ref.page_size_bytes <= page:
                raise ConfigError(
                    f"{field}.page_size_bytes",
                    ref.page_size_bytes,
                    f"1 to {page} (the padded page size of tensor {ref.tensor_idx})",
                )
            # two layers of one group on one tensor: the larger un-padded size covers both
            row[ref.tensor_idx] = max(row[ref.tensor_idx], ref.page_size_bytes)
        copy_bytes.append(row)
    return copy_bytes


class CpuGpuOffloadingHandlers:
    """The store and load handlers of one worker, sharing one layout and one region.

    Who calls it: the worker process, once at start-up (through
    :meth:`kvtier.TieredOffloadingSpec.get_handlers`, or directly). Construction may block
    briefly (it creates CUDA streams lazily, not here); :meth:`shutdown` blocks until queued
    jobs finish.

    Attributes ``gpu_to_cpu_handler`` and ``cpu_to_gpu_handler`` are the two handlers;
    ``expedited_load_handler`` a second load handler on an engine (and streams) of its own,
    or ``None`` unless asked for: loads a caller waits for within its step do not queue
    behind the others there (vLLM's ``submit_load(expedited=True)``).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        region: SharedRegion,
        block_size_factor: int,
        *,
        engine: str = "auto",
        owns_region: bool = False,
        shard: ShardPlacement | None = None,
        expedited_loads: bool = False,
    ):
        """``region``: the CPU tier's rows (attached and, on CUDA, pinned by the caller), one
        row per offloaded block of ``block_size_factor`` GPU blocks. ``engine``: ``auto``,
        ``cuda``, ``kernel`` or ``thread`` (:mod:`kvtier.worker.engines`). ``owns_region``: close the region at :meth:`shutdown`.
        ``shard``: this worker's place in the rows under tensor or pipeline parallelism
        (default: a single worker, whose shard is the whole row); a worker that does not
        write its replicated shard gets a store handler that copies nothing.
        ``expedited_loads``: also build ``expedited_load_handler``.

        Raises :class:`~kvtier.errors.ConfigError` when the cache, the shard and the region
        disagree.
        """
        if not kv_caches.tensors:
            raise ConfigError("kv_caches.tensors", [], "at least one KV cache tensor")
        page_bytes = [entry.page_size_bytes for entry in kv_caches.tensors]
        pages = [
            _pages_view(entry.tensor, entry.page_size_bytes, i) for i, entry in enumerate(kv_caches.tensors)
        ]
        devices = {p.device for p in pages}
        if len(devices) != 1:
            raise ConfigError("kv_caches.tensors", sorted(map(str, devices)), "tensors on one device")
        shard_bytes = block_size_factor * sum(page_bytes)
        if shard is None:
            shard = ShardPlacement.single(shard_bytes)
        if shard.shard_bytes != shard_bytes:
            raise ConfigError(
                "shard.shard_bytes",
                shard.shard_bytes,
                f"{shard_bytes}: block_size_factor {block_size_factor} x the pages of every "
                f"tensor of this worker ({sum(page_bytes)} bytes)",
                "every worker must have the same bytes per block; build the placement from them",
            )
        if region.row_bytes != shard.row_bytes:
            raise ConfigError(
                "region.row_bytes",
                region.row_bytes,
                f"{shard.row_bytes}: {shard.num_shards} shard(s) of block_size_factor "
                f"{block_size_factor} x the pages of every tensor ({sum(page_bytes)} bytes)",
                "build the CPU tier with block_bytes = shards * factor * sum(page_bytes)",
            )
        #: this worker's place in the rows
        self.shard = shard
        self.region = region
        self.layout = TransferLayout(
            page_bytes=page_bytes,
            block_size_factor=block_size_factor,
            group_copy_bytes=_group_copy_bytes(kv_caches),
            gpu_num_blocks=[p.shape[0] for p in pages],
            gpu_block_strides=[p.stride(0) for p in pages],
            cpu_num_rows=region.num_rows,
            cpu_row_stride=region.row_stride,
            shard_offset=shard.offset,
        )
        self.buffers = CopyBuffers(pages, region)
        self._owns_region = owns_region
        store = make_engine(engine, self.buffers, True, priority=STORE_PRIORITY)
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            self.layout, store, on_shutdown=self._handler_stopped, copies=shard.writes
        )

        def load_handler() -> SingleDirectionOffloadingHandler:
            load = make_engine(engine, self.buffers, False, priority=LOAD_PRIORITY)
            return SingleDirectionOffloadingHandler(self.layout, load, on_shutdown=self._handler_stopped)

        self.cpu_to_gpu_handler = load_handler()
        self.expedited_load_handler = load_handler() if expedited_loads else None
        self._handlers = [self.gpu_to_cpu_handler, self.cpu_to_gpu_handler]
        if self.expedited_load_handler is not None:
            self._handlers.append(self.expedited_load_handler)
        self._running = len(self._handlers)

    def _handler_stopped(self) -> None:
        # The region may only go once neither direction can touch it any more; handlers are
        # often shut down one by one (OffloadingWorker.shutdown), so count them.
        self._running -= 1
        if self._running == 0 and self._owns_region:
            self.region.close()

    def shutdown(self) -> None:
        """Drain and stop the handlers, then close the region if this object owns it.

        Idempotent. Shutting the handlers down one by one has the same effect.
        """
        for handler in self._handlers:
            handler.shutdown()

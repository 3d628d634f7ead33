"""What a copy engine is: it runs the planned copies of one direction, in submission order.

A handler (:class:`~kvtier.worker.cpu_gpu.SingleDirectionOffloadingHandler`) turns a spec
into :class:`~kvtier.worker.blocks.Segments` and hands them to its engine; the engine moves
the bytes on a CUDA stream (:class:`~kvtier.worker.engines.cuda.CudaCopyEngine`) or on a
background thread (:class:`~kvtier.worker.engines.thread.ThreadCopyEngine`) and reports
each job once, in submission order.

Both engines issue the same thing: one ``(dst pointer, src pointer, size)`` descriptor per
coalesced segment, built by :meth:`CopyBuffers.descriptors` from the same plan. So the CPU
path runs, byte for byte, the copies the CUDA path hands to the driver.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtier.base import TransferResult
from kvtier.worker.blocks import Segments
from kvtier.tiers.cpu.region import SharedRegion

logger = logging.getLogger(__name__)

__all__ = ["CopyBuffers", "CopyEngine", "copy_segments_torch"]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D int8 view of every byte a ``(num_blocks, page)`` tensor spans, gaps included."""
    num_blocks, page = tensor.shape
    extent = (num_blocks - 1) * tensor.stride(0) + page if num_blocks else 0
    return torch.as_strided(tensor, (extent,), (1,), tensor.storage_offset())


class CopyBuffers:
    """The memory a worker copies between: the GPU cache's tensors and the CPU region's rows.

    Holds flat byte views (which also keep the memory alive while copies run), their base
    addresses and their extents. Built once per worker; read-only afterwards, so both
    directions share one.
    """

    def __init__(self, gpu_pages: Sequence[torch.Tensor], region: SharedRegion):
        """``gpu_pages[t]``: tensor ``t`` as ``(num_blocks, page_bytes)`` int8, pages contiguous."""
        for t, pages in enumerate(gpu_pages):
            if pages.dim() != 2 or pages.dtype != torch.int8 or (pages.shape[1] > 1 and pages.stride(1) != 1):
                raise ValueError(
                    f"tensor {t} must be a (num_blocks, page_bytes) int8 view with contiguous "
                    f"pages; got shape {tuple(pages.shape)}, dtype {pages.dtype}, "
                    f"strides {pages.stride()}"
                )
        self.gpu = [_flat_bytes(pages) for pages in gpu_pages]
        self.gpu_bases = np.array([flat.data_ptr() for flat in self.gpu], dtype=np.uint64)
        self.gpu_extents = np.array([flat.numel() for flat in self.gpu], dtype=np.int64)
        self.gpu_strides = np.array([pages.stride(0) for pages in gpu_pages], dtype=np.int64)
        self.page_bytes = np.array([pages.shape[1] for pages in gpu_pages], dtype=np.int64)
        self.device = gpu_pages[0].device if gpu_pages else torch.device("cpu")
        # The rows as one flat span, row padding included: segments address the region by
        # byte offset from row 0, and a DMA or memmove needs one base pointer for all rows.
        extent = region.num_rows * region.row_stride
        flat = np.lib.stride_tricks.as_strided(region.rows, shape=(extent,), strides=(1,))
        self.cpu = torch.from_numpy(flat).view(torch.int8)
        self.cpu_base = np.uint64(self.cpu.data_ptr())
        self.cpu_extent = extent
        self.row_stride = region.row_stride
        assert int(self.cpu_base) == region.address, "the flat view must start at row 0"

    def descriptors(self, segments: Segments, gpu_to_cpu: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dst pointers, src pointers, sizes)`` as uint64 arrays, one entry per segment.

        Any thread; never blocks. Asserts every copy stays inside its buffers: the plan
        validated the ids, and this is the last check before raw pointers reach a DMA
        engine or ``memmove``.
        """
        t = segments.tensor_idx
        assert not len(t) or (
            (segments.gpu_offsets >= 0).all()
            and (segments.gpu_offsets + segments.sizes <= self.gpu_extents[t]).all()
            and (segments.cpu_offsets >= 0).all()
            and (segments.cpu_offsets + segments.sizes <= self.cpu_extent).all()
        ), "a planned copy leaves its buffer"
        gpu = self.gpu_bases[t] + segments.gpu_offsets.astype(np.uint64)
        cpu = self.cpu_base + segments.cpu_offsets.astype(np.uint64)
        sizes = segments.sizes.astype(np.uint64)
        return (cpu, gpu, sizes) if gpu_to_cpu else (gpu, cpu, sizes)


def copy_segments_torch(
    buffers: CopyBuffers, segments: Segments, gpu_to_cpu: bool, non_blocking: bool
) -> None:
    """One ``Tensor.copy_`` per segment: the portable way, one ``cudaMemcpyAsync`` each on CUDA.

    The CUDA engine's fallback when the driver has no batched copy; device-agnostic, so the
    CPU tests run it too. Called on the thread that owns the current stream.
    """
    cpu = buffers.cpu
    for t, gpu_at, cpu_at, size in zip(
        segments.tensor_idx.tolist(),
        segments.gpu_offsets.tolist(),
        segments.cpu_offsets.tolist(),
        segments.sizes.tolist(),
    ):
        gpu_part = buffers.gpu[t][gpu_at : gpu_at + size]
        cpu_part = cpu[cpu_at : cpu_at + size]
        if gpu_to_cpu:
            cpu_part.copy_(gpu_part, non_blocking=non_blocking)
        else:
            gpu_part.copy_(cpu_part, non_blocking=non_blocking)


class CopyEngine(ABC):
    """Runs the copy jobs of one direction, each job after the one submitted before it.

    Who calls it: one handler, from the engine's worker thread (the one that calls
    ``transfer_async``). No method is called concurrently with another.

    The caller guarantees: job ids are unique among jobs not yet reported; the segments were
    planned against the engine's :class:`CopyBuffers`; the buffers stay alive until
    :meth:`shutdown` returned.

    The implementation must: start job ``n`` only after job ``n-1`` finished; never block in
    :meth:`submit` on the copy itself; report each job exactly once through
    :meth:`get_finished`, in submission order, with ``success=False`` (and one log line with
    the reason) if any of its bytes may not have arrived; keep going with later jobs after a
    failed one.
    """

    def __init__(self, buffers: CopyBuffers, gpu_to_cpu: bool, *, priority: int = 0):
        """``priority``: the direction's urgency (lower is more urgent; loads get the lower),
        which :func:`~kvtier.worker.engines.make_engine` always passes; an engine may ignore it."""
        self.buffers = buffers
        #: True: stores (GPU to CPU); False: loads (CPU to GPU)
        self.gpu_to_cpu = gpu_to_cpu
        #: how many jobs ended with success=False
        self.failed_jobs = 0

    @property
    def direction(self) -> str:
        return "GPU->CPU" if self.gpu_to_cpu else "CPU->GPU"

    def _failed(self, job_id: int, error: BaseException) -> TransferResult:
        """Count and log a failed job once; its result (``success=False``, no bytes)."""
        self.failed_jobs += 1
        logger.warning(
            "%s transfer job %d failed, reported as unsuccessful: %s: %s",
            self.direction,
            job_id,
            type(error).__name__,
            error,
        )
        return TransferResult(job_id, False, 0, None)

    @abstractmethod
    def submit(self, job_id: int, segments: Segments) -> None:
        """Queue the job's copies behind every earlier job; returns without waiting for them."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, oldest first; never waits.

        A finished job is held back while an older one is still running, so results come
        in submission order.
        """

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every job named (and so every older job) has finished.

        Unknown ids (already reported, or never submitted) are ignored. Results stay queued
        for :meth:`get_finished`.
        """

    def shutdown(self) -> None:
        """Wait for every queued job and release the engine's threads or streams. Idempotent."""

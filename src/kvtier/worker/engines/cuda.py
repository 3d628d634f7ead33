"""The CUDA path: each job on its own stream, chained behind the previous job of its direction.

Per job (:meth:`CudaCopyEngine.submit`, on the worker's thread):

1. take a stream from the engine's pool: streams the engine created through the driver, at
   the engine's priority (loads run at a higher priority than stores, so a request waiting
   for its prefix is not stuck behind offloading traffic), never shared with the model
   (torch's own streams are a shared pool, and vLLM computes on one of them);
2. make it wait for the engine's compute stream (the current stream at submit: a store must
   read finished KV, a load must not overwrite blocks the compute stream still uses) and for
   the previous job's end event (jobs of one direction finish in submission order);
3. issue every coalesced segment of the job with **one** ``cuMemcpyBatchAsync`` call, so the
   copy engines (DMA), not the SMs, move the bytes and the cost per job is one driver call
   whatever the number of pages; where the driver lacks it (before CUDA 12.8), one
   ``cudaMemcpyAsync`` per segment through ``Tensor.copy_``;
4. record an end event. :meth:`get_finished` polls events with ``query()``; :meth:`wait`
   synchronizes on events only. Nothing here synchronizes the device.

DMA descriptors, not a gather kernel into a staging buffer: they need no GPU memory beyond
the engine's own, copy exactly the bytes named (the row layout has gaps), and leave the SMs to
the model (docs/design/worker.md#dma-descriptors-not-a-staging-buffer).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.base import TransferResult
from kvtier.cuda import device_address_offset, stream_create
from kvtier.worker.blocks import Segments
from kvtier.worker.engines.base import CopyBuffers, CopyEngine, copy_segments_torch
from kvtier.worker.engines.memcpy_batch import MemcpyBatch, MemcpyBatchError

__all__ = ["CudaCopyEngine"]

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    job_id: int
    nbytes: int
    stream: torch.cuda.Stream
    start: torch.cuda.Event
    end: torch.cuda.Event
    # the descriptor arrays and what _prepare gave the job, referenced until the job is done:
    # nothing then depends on when the driver or a queued copy stops reading them
    descriptors: Any
    issued: Any
    error: BaseException | None


class CudaCopyEngine(CopyEngine):
    """One direction's copies on CUDA streams; the GPU tensors must be on one CUDA device.

    Who calls it: the handler, from the worker thread that runs the model (its current
    stream is taken as the compute stream). Not thread-safe.
    """

    def __init__(self, buffers: CopyBuffers, gpu_to_cpu: bool, *, priority: int = 0):
        """``priority``: CUDA stream priority, lower is more urgent (torch: 0 or negative)."""
        super().__init__(buffers, gpu_to_cpu)
        if buffers.device.type != "cuda":
            raise ValueError(f"the cuda engine needs CUDA tensors; the KV tensors are on {buffers.device}")
        self._device = buffers.device
        self._priority = priority
        self._streams: list[torch.cuda.Stream] = []
        self._taken: list[torch.cuda.Stream] = []  # every stream taken from the shared pool
        self._events: list[torch.cuda.Event] = []
        self._jobs: deque[_Job] = deque()
        self._last_end: torch.cuda.Event | None = None
        # where this engine's streams come from and go back to in the process-wide pool (a
        # CUDA tensor's device always names its index)
        self._pool_key = (self._device.index, priority)
        with torch.cuda.device(self._device):
            # a runtime call that binds the device's context to this thread (once, at start),
            # which the driver calls below run in
            torch.cuda.synchronize(self._device)
            self.rows_mapped_at = device_address_offset(int(buffers.cpu_base))
            self._streams += [self._new_stream() for _ in range(2)]
        if self.rows_mapped_at is None:
            logger.warning(
                "%s: the CPU rows are not pinned (cudaHostRegister failed or pin_memory is off): "
                "the driver stages every copy, and transfer_async waits for the model's queued "
                "GPU work before it returns; pin them (pin_memory: on refuses to start without)",
                self.direction,
            )
        self._batch = MemcpyBatch.load()
        if self._batch is None:
            logger.info(
                "%s copies use one cudaMemcpyAsync per segment: the CUDA driver has no "
                "cuMemcpyBatchAsync (needs 12.8+)",
                self.direction,
            )
        #: the function that issues one job's copies on the current stream (replaceable)
        self.issue = self._issue

    def _new_stream(self) -> torch.cuda.Stream:
        stream = _take_stream(self._pool_key, self._device)
        self._taken.append(stream)
        return stream

    def _prepare(self, descriptors: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Any:
        """What a job needs besides its descriptors, taken before anything is queued for it;
        kept with the job until its end event passed, then given to :meth:`_release`, even
        when the job failed (nothing here)."""
        return None

    def _release(self, issued: Any) -> None:
        """Take back what :meth:`_prepare` gave a job that is done (nothing here)."""

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def submit(self, job_id: int, segments: Segments) -> None:
        """Enqueue the job on a fresh stream behind the compute stream and the previous job.

        Never waits for a copy. A failure to enqueue is not raised: the job is reported
        with ``success=False`` in its turn.
        """
        with torch.cuda.device(self._device):
            stream = self._streams.pop() if self._streams else self._new_stream()
            start, end = self._event(), self._event()
            error: BaseException | None = None
            descriptors = issued = None
            try:
                # host work first, so the start event below is close to the copies' start
                descriptors = self.buffers.descriptors(segments, self.gpu_to_cpu)
                issued = self._prepare(descriptors)
            except Exception as exc:  # noqa: BLE001 - any failure fails this job only; the chain goes on
                error = exc
            stream.wait_stream(torch.cuda.current_stream(self._device))
            if self._last_end is not None:
                stream.wait_event(self._last_end)
            start.record(stream)
            if error is None:
                assert descriptors is not None  # _prepare ran without error
                try:
                    with torch.cuda.stream(stream):
                        self.issue(descriptors, segments, stream, issued)
                except Exception as exc:  # noqa: BLE001 - as above
                    error = exc
            # Recorded even after a failure, so the next job still waits for whatever of
            # this one was enqueued before the error.
            end.record(stream)
        self._last_end = end
        self._jobs.append(_Job(job_id, segments.nbytes, stream, start, end, descriptors, issued, error))

    def _issue(
        self,
        descriptors: tuple[np.ndarray, np.ndarray, np.ndarray],
        segments: Segments,
        stream: torch.cuda.Stream,
        prepared: Any,
    ) -> None:
        if self._batch is not None:
            try:
                self._batch(*descriptors, stream.cuda_stream, src_access_any=not self.gpu_to_cpu)
                return
            except MemcpyBatchError as exc:
                # Copies before the failing one may be enqueued; the fallback re-issues all
                # of them behind those on the same stream, so the bytes end up the same.
                logger.warning(
                    "%s: %s; using one cudaMemcpyAsync per segment from now on", self.direction, exc
                )
                self._batch = None
        copy_segments_torch(self.buffers, segments, self.gpu_to_cpu, non_blocking=True)

    def _finish(self, job: _Job, error: BaseException | None) -> TransferResult:
        self._streams.append(job.stream)
        if job.end is self._last_end:
            # nothing left to wait for; and the event may now be re-recorded by a later job
            self._last_end = None
        if job.issued is not None:
            self._release(job.issued)  # its end event passed: nothing queued reads it any more
        if error is None:
            elapsed_s = job.start.elapsed_time(job.end) / 1000.0
            self._events += (job.start, job.end)
            return TransferResult(job.job_id, True, job.nbytes, elapsed_s)
        return self._failed(job.job_id, error)

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs, oldest first, by ``Event.query()``; never waits."""
        results = []
        while self._jobs:
            job = self._jobs[0]
            try:
                if not job.end.query():
                    break
                error = job.error
            except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
                error = exc
            self._jobs.popleft()
            results.append(self._finish(job, error))
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block on the end events of the named jobs (never on the whole device)."""
        wanted = set(job_ids)
        for job in list(self._jobs):
            if job.job_id in wanted:
                try:
                    job.end.synchronize()
                except RuntimeError as exc:
                    job.error = job.error or exc

    def shutdown(self) -> None:
        """Wait for every queued job's end event; drop the pools and give the streams back
        to the process's pool. Idempotent."""
        for job in self._jobs:
            try:
                job.end.synchronize()
            except RuntimeError as exc:
                job.error = job.error or exc
        self._streams.clear()
        self._events.clear()
        self._last_end = None
        # every job is done by now, so the streams are idle and another engine may take them
        _give_back_streams(self._pool_key, self._taken)
        self._taken = []


# Copy streams are made through the driver (kvtier.cuda.stream_create), so none is ever the
# model's: torch's own streams are a shared pool of 32 per priority, and vLLM computes on
# one of them. They are never destroyed (torch's pinned-memory cache records events on the
# streams that used a buffer, when the buffer is freed, possibly after the engine is gone);
# an engine that shuts down gives its streams back for the next engine to take, so a
# process holds as many as its engines ever used at once.
_stream_pool: dict[tuple[int, int], list[torch.cuda.Stream]] = {}  # by (device, priority)
_stream_pool_lock = threading.Lock()


def _take_stream(key: tuple[int, int], device: torch.device) -> torch.cuda.Stream:
    """An idle copy stream of ``key`` = (device index, priority): from the pool, else a new one
    made through the driver, else (no driver entry point) one of torch's that is not the
    current stream. Call with the device's context current in this thread."""
    with _stream_pool_lock:
        if _stream_pool.get(key):
            return _stream_pool[key].pop()
    priority = key[1]
    handle = stream_create(priority)
    if handle is not None:
        return torch.cuda.ExternalStream(handle, device=device)
    compute = torch.cuda.current_stream(device).cuda_stream
    for _ in range(64):  # the pool has 32 streams per priority
        stream = torch.cuda.Stream(device=device, priority=priority)
        if stream.cuda_stream != compute:
            return stream
    raise RuntimeError("no CUDA stream other than the compute stream could be had")


def _give_back_streams(key: tuple[int, int], streams: list[torch.cuda.Stream]) -> None:
    """Return idle streams from :func:`_take_stream` to the pool."""
    with _stream_pool_lock:
        _stream_pool.setdefault(key, []).extend(streams)

"""The CPU path: copies on one background thread, for machines without CUDA (CI, laptops).

The engine's "GPU" tensors are CPU tensors standing in for the KV cache. Each job runs the
same ``(dst, src, size)`` descriptors the CUDA engine would hand to the driver, as
``memmove`` calls on a single worker thread, so jobs finish in submission order exactly as
chained CUDA streams would. ``ctypes.memmove`` releases the GIL while it copies, so the
engine's caller keeps running during large copies.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from kvtier.base import TransferResult
from kvtier.worker.blocks import Segments
from kvtier.worker.engines.base import CopyBuffers, CopyEngine

__all__ = ["ThreadCopyEngine", "memmove_descriptors"]


def memmove_descriptors(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    """Run each ``(dst, src, size)`` descriptor as one ``memmove``, in order.

    One Python-level call per coalesced segment, not a numpy gather, which copies twice and
    needs a scatter for the row layout's gaps (docs/design/worker.md#the-thread-engine).
    """
    move = ctypes.memmove
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        move(dst, src, size)


@dataclass
class _Job:
    job_id: int
    nbytes: int
    future: Future


class ThreadCopyEngine(CopyEngine):
    """One direction's copies on one background thread; the buffers must be CPU memory.

    Who calls it: the handler's caller thread; the copies run on the engine's own thread
    (``kvtier-store`` or ``kvtier-load``). Only that thread touches the destination bytes
    while a job runs.
    """

    def __init__(self, buffers: CopyBuffers, gpu_to_cpu: bool, *, priority: int = 0):
        """``priority`` is accepted for symmetry with the CUDA engine and ignored: the two
        directions already run on separate threads, and the OS schedules both."""
        super().__init__(buffers, gpu_to_cpu)
        if buffers.device.type != "cpu":
            raise ValueError(
                f"the thread engine copies CPU memory only; the KV tensors are on {buffers.device} "
                f"(use the cuda engine)"
            )
        # One worker thread: a single FIFO queue is what orders the jobs of one direction.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtier-store" if gpu_to_cpu else "kvtier-load"
        )
        self._jobs: deque[_Job] = deque()
        #: the function that runs one job's descriptors (replaceable, e.g. by tests)
        self.copy = memmove_descriptors

    def submit(self, job_id: int, segments: Segments) -> None:
        """Queue the job on the engine's thread; never waits for the copy."""
        descriptors = self.buffers.descriptors(segments, self.gpu_to_cpu)
        future = self._executor.submit(self._run, job_id, descriptors)
        self._jobs.append(_Job(job_id, segments.nbytes, future))

    def _run(self, job_id: int, descriptors: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
        # Runs on the engine thread. An exception here becomes the job's failure.
        started = time.perf_counter()
        self.copy(*descriptors)
        return time.perf_counter() - started

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs, oldest first; never waits."""
        results = []
        while self._jobs and self._jobs[0].future.done():
            results.append(self._result(self._jobs.popleft()))
        return results

    def _result(self, job: _Job) -> TransferResult:
        error = job.future.exception()
        if error is None:
            return TransferResult(job.job_id, True, job.nbytes, job.future.result())
        return self._failed(job.job_id, error)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs (and all older ones) have run."""
        wanted = set(job_ids)
        futures = [job.future for job in self._jobs if job.job_id in wanted]
        wait_futures(futures)

    def shutdown(self) -> None:
        """Let queued jobs finish, then stop the thread. Idempotent; results stay readable."""
        self._executor.shutdown(wait=True)

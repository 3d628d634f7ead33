"""kvtier's GPU<->CPU handlers seen through vLLM 0.33's ``OffloadingWorker`` API.

vLLM's connector worker (``OffloadingConnectorWorker``) builds one worker per worker process
with ``spec.get_worker(kv_caches)`` and then calls ``submit_store`` / ``submit_load`` /
``get_finished`` / ``wait`` from the model runner's thread. :class:`KvtierOffloadingWorker`
converts vLLM's specs and canonical caches to kvtier's and hands the jobs to
:class:`kvtier.worker.CpuGpuOffloadingHandlers` (CUDA streams and batched DMA on a GPU, a
copy thread with CPU tensors).

The CPU region is attached in the background. vLLM initialises the workers' KV caches — and
so calls ``get_worker`` — *before* it builds the scheduler whose ``get_manager`` creates the
region, so the worker cannot wait for the region at ``get_worker`` (in a single-process engine
it would wait for itself). It attaches at once if the region already exists; otherwise a
thread waits for the region's file and then attaches, pins it (``cudaHostRegister``: about
0.1 s per GB) and builds the handlers (CUDA streams; the kernel engine's compile), off the
model runner's thread. vLLM captures its CUDA graphs before it builds the scheduler, so none
of this runs during a capture. A first job that comes before the thread is done waits for
it; one whose start failed raises the start's error.

Failed jobs. vLLM 0.33's connector asserts that every transfer succeeded and completes a job
once every worker acknowledged it. A failed *store* is therefore acknowledged as a success
after its rows were marked failed (:mod:`kvtier.worker.failures`); the manager drops the
marked blocks when vLLM completes the job, so under tensor or pipeline parallelism one
rank's failure fails the block on every rank and no half-written row is ever served. A failed
*load* is reported as failed: its GPU blocks hold wrong bytes, and vLLM stopping on its
assertion is better than a model computing from them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec as VllmBlockIDsSpec,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches as VllmCanonicalKVCaches,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec as VllmGPUSpec,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec as VllmLoadStoreSpec,
)
from vllm.v1.kv_offload.base import (
    OffloadingWorker,
    TransferResult,
)

from kvtier.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    OffloadingHandler,
)
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.spec import TieredOffloadingSpec as StandaloneSpec
from kvtier.worker.failures import FailedRowMarks

__all__ = ["KvtierOffloadingWorker", "to_kvtier_caches"]

logger = logging.getLogger("vllm.kvtier")


def to_kvtier_caches(kv_caches: VllmCanonicalKVCaches) -> CanonicalKVCaches:
    """vLLM's canonical caches as kvtier's (same tensors, no copy; vLLM's per-ref canonical
    mappings are dropped: kvtier's rows hold a worker's pages as they are)."""
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t.tensor, t.page_size_bytes) for t in kv_caches.tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ],
    )


def _gpu_spec(spec: VllmLoadStoreSpec) -> GPULoadStoreSpec:
    if isinstance(spec, GPULoadStoreSpec):
        return spec
    if not isinstance(spec, VllmGPUSpec):
        # ValueError, as kvtier's handlers raise for every malformed spec: one kind of caller bug
        raise ValueError(  # noqa: TRY004
            f"expected vLLM's GPULoadStoreSpec for the GPU side, got {type(spec).__name__}"
        )
    return GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)


def _cpu_spec(spec: VllmLoadStoreSpec) -> CPULoadStoreSpec:
    if isinstance(spec, CPULoadStoreSpec):
        return spec
    # vLLM's CPULoadStoreSpec, as KvtierOffloadingManager hands them out: rows of the region
    if not isinstance(spec, VllmBlockIDsSpec) or isinstance(spec, VllmGPUSpec):
        raise ValueError(  # noqa: TRY004
            f"expected the CPU rows the kvtier manager handed out, got {type(spec).__name__}"
        )
    return CPULoadStoreSpec(spec.block_ids)


class KvtierOffloadingWorker(OffloadingWorker):
    """The store (GPU->CPU) and load (CPU->GPU) handlers of one worker process.

    Who calls it: vLLM's connector worker, from the model runner's thread. ``submit_*`` and
    :meth:`get_finished` never wait, except that a ``submit_*`` before the background start
    is done waits for it (see the module docstring); :meth:`wait` and :meth:`shutdown` block.

    ``standalone`` is kvtier's own spec for this worker (configuration with the region's
    path, the worker's page sizes); ``kv_caches`` are kvtier's canonical caches.
    """

    def __init__(
        self,
        standalone: StandaloneSpec,
        kv_caches: CanonicalKVCaches,
        find_region: Callable[[], str | None] | None = None,
    ):
        """``find_region``: where the scheduler created the region, once it has (None until
        then); by default the spec's ``region_path``, once it exists."""
        self._standalone = standalone
        self._find_region = find_region or self._region_at_its_path
        self._kv_caches = kv_caches
        self._store: OffloadingHandler | None = None
        self._load: OffloadingHandler | None = None
        self._expedited: OffloadingHandler | None = None
        self._failed_rows: FailedRowMarks | None = None
        #: CPU rows of each store job in flight, to mark if the job fails
        self._store_rows: dict[int, np.ndarray] = {}
        self._closed = False
        self._ready = threading.Event()
        self._start_lock = threading.Lock()
        self._start_error: BaseException | None = None
        self._starter: threading.Thread | None = None
        if self._located():
            self._start()
        else:
            self._starter = threading.Thread(
                target=self._start_when_created, name="kvtier-worker-attach", daemon=True
            )
            self._starter.start()

    def _region_at_its_path(self) -> str | None:
        path = self._standalone.region_path
        return path if os.path.exists(path) else None

    def _located(self) -> bool:
        """Whether the region exists; the spec then points at it (where it was found)."""
        path = self._find_region()
        if path is None:
            return False
        self._standalone.region_path = path
        return True

    def _start(self) -> None:
        """Attach to the region and build the handlers, once (any thread; a second caller
        waits for the first). Waits up to the spec's attach timeout for the region, then
        raises :class:`~kvtier.errors.KvtierError` naming the path."""
        with self._start_lock:
            if self._ready.is_set():
                return
            deadline = time.monotonic() + self._standalone.attach_timeout_s
            while not self._located() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._failed_rows is None:
                # the marks first: the scheduler side creates them right after the region
                self._failed_rows = FailedRowMarks.attach(
                    self._standalone.region_path, self._standalone.attach_timeout_s
                )
            handlers = self._standalone.build_handlers(self._kv_caches, expedited_loads=True)
            self._store = handlers.gpu_to_cpu_handler
            self._load = handlers.cpu_to_gpu_handler
            self._expedited = handlers.expedited_load_handler
            self._ready.set()
        logger.info("kvtier worker attached to the CPU tier at %s", self._standalone.region_path)

    def _start_when_created(self) -> None:
        """The background start: wait for the region's file, then :meth:`_start`."""
        try:
            while not self._located():
                if self._closed:
                    return
                time.sleep(0.05)
            if not self._closed:
                self._start()
        except BaseException as exc:  # noqa: BLE001 - kept for the first job to raise
            self._start_error = exc
            logger.error("kvtier worker could not attach to the CPU tier: %s", exc)

    def _started(self) -> None:
        """Before a job: the handlers, built by the background start or here and now."""
        if self._ready.is_set():
            return
        if self._start_error is not None:
            raise self._start_error
        self._start()  # waits for a start under way, or attaches on this thread

    @property
    def started(self) -> bool:
        """Whether the region is attached and the handlers built."""
        return self._ready.is_set()

    def submit_store(self, job_id: int, src_spec: VllmGPUSpec, dst_spec: VllmLoadStoreSpec) -> bool:
        """Queue the copy of GPU blocks ``src_spec`` into CPU rows ``dst_spec``; True if queued."""
        if self._closed:
            return False
        self._started()
        assert self._store is not None
        cpu = _cpu_spec(dst_spec)
        queued = self._store.transfer_async(job_id, (_gpu_spec(src_spec), cpu))
        if queued:
            self._store_rows[job_id] = cpu.block_ids
        return queued

    def submit_load(
        self,
        job_id: int,
        src_spec: VllmLoadStoreSpec,
        dst_spec: VllmGPUSpec,
        expedited: bool = False,
    ) -> bool:
        """Queue the copy of CPU rows ``src_spec`` into GPU blocks ``dst_spec``.

        Loads run ahead of stores, on higher-priority streams. An ``expedited`` load (one
        vLLM waits for within the step) goes to a load handler of its own, so it does not
        queue behind the ordinary loads (which finish in submission order among themselves).
        """
        if self._closed:
            return False
        self._started()
        handler = self._expedited if expedited else self._load
        assert handler is not None
        return handler.transfer_async(job_id, (_cpu_spec(src_spec), _gpu_spec(dst_spec)))

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (stores, then loads); never waits."""
        if not self._ready.is_set():
            return []
        assert self._store is not None and self._load is not None and self._expedited is not None
        results = []
        for result in self._store.get_finished():
            rows = self._store_rows.pop(result.job_id, None)
            success = result.success
            if not success and rows is not None and self._failed_rows is not None:
                # before the acknowledgement leaves this process: see the module docstring
                self._failed_rows.mark(rows)
                logger.error(
                    "kvtier store job %d failed (see the kvtier error logged above); its "
                    "%d block(s) are dropped on every rank and will be recomputed",
                    result.job_id,
                    len(rows),
                )
                success = True
            results.append(
                TransferResult(
                    job_id=result.job_id,
                    success=success,
                    transfer_size=result.transfer_size,
                    transfer_time=result.transfer_time,
                )
            )
        for result in [*self._load.get_finished(), *self._expedited.get_finished()]:
            if not result.success:
                # vLLM 0.33's connector does not handle failed transfers (it asserts); say
                # which job and why before it does.
                logger.error(
                    "kvtier load job %d failed (see the kvtier error logged above); vLLM's "
                    "offloading connector cannot recover from a failed load",
                    result.job_id,
                )
            results.append(
                TransferResult(
                    job_id=result.job_id,
                    success=result.success,
                    transfer_size=result.transfer_size,
                    transfer_time=result.transfer_time,
                )
            )
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs have finished (their results still come from get_finished)."""
        if not self._ready.is_set():
            return
        assert self._store is not None and self._load is not None and self._expedited is not None
        ids = set(job_ids)
        self._store.wait(ids)
        self._load.wait(ids)
        self._expedited.wait(ids)

    def shutdown(self) -> None:
        """Wait for queued jobs, stop the handlers, release the region. Idempotent."""
        self._closed = True
        if self._starter is not None:
            # a start under way finishes first, so its handlers are shut down below
            self._starter.join()
        self._standalone.shutdown()
        if self._failed_rows is not None:
            self._failed_rows.close()

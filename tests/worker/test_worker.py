"""OffloadingWorker: jobs go to the handler of their media; results and waits come back."""

from __future__ import annotations

import pytest

from kvtier.base import OffloadingHandler, TransferResult
from kvtier.worker.worker import OffloadingWorker
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec, MemoryLoadStoreSpec


class RecordingHandler(OffloadingHandler):
    """Finishes every job at the next get_finished; remembers what it was asked."""

    def __init__(self, accept: bool = True):
        self.accept = accept
        self.submitted: list[int] = []
        self.waited: list[set[int]] = []
        self.pending: list[int] = []
        self.shutdowns = 0

    def transfer_async(self, job_id, spec):
        self.submitted.append(job_id)
        if self.accept:
            self.pending.append(job_id)
        return self.accept

    def get_finished(self):
        done, self.pending = self.pending, []
        return [TransferResult(job_id, True, 1) for job_id in done]

    def wait(self, job_ids):
        self.waited.append(set(job_ids))

    def shutdown(self):
        self.shutdowns += 1


def store_spec():
    return GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([0])


def load_spec():
    return CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1])


@pytest.fixture
def worker():
    w = OffloadingWorker()
    w.store, w.load = RecordingHandler(), RecordingHandler()
    w.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, w.store)
    w.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, w.load)
    return w


def test_jobs_are_routed_by_medium_pair(worker):
    assert worker.transfer_async(1, store_spec())
    assert worker.transfer_async(2, load_spec())
    assert worker.transfer_async(3, store_spec())
    assert worker.store.submitted == [1, 3] and worker.load.submitted == [2]
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3]


def test_wait_goes_to_the_handlers_of_the_named_jobs(worker):
    worker.transfer_async(1, store_spec())
    worker.transfer_async(2, load_spec())
    worker.wait({2, 77})
    assert worker.load.waited == [{2}] and worker.store.waited == []
    worker.get_finished()
    worker.wait({1, 2})  # finished jobs are no longer tracked
    assert worker.store.waited == [] and worker.load.waited == [{2}]


def test_unknown_pair_is_an_error(worker):
    with pytest.raises(ValueError, match="no handler for transfers MEMORY -> GPU"):
        worker.transfer_async(1, (MemoryLoadStoreSpec([0]), GPULoadStoreSpec([0], [1])))


def test_pair_registered_twice_is_an_error(worker):
    with pytest.raises(ValueError, match="already have a handler"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, RecordingHandler())


def test_job_id_in_flight_is_an_error(worker):
    worker.transfer_async(1, store_spec())
    with pytest.raises(ValueError, match="still in flight"):
        worker.transfer_async(1, load_spec())
    worker.get_finished()
    assert worker.transfer_async(1, load_spec())


def test_refused_job_is_not_tracked():
    worker = OffloadingWorker()
    handler = RecordingHandler(accept=False)
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    assert worker.transfer_async(1, store_spec()) is False
    worker.wait({1})
    assert handler.waited == []


def test_shutdown_reaches_each_handler_once():
    worker = OffloadingWorker()
    shared = RecordingHandler()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, shared)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, shared)
    worker.shutdown()
    assert shared.shutdowns == 1

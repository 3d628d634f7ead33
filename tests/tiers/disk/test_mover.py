"""The mover: jobs run off the caller's thread, loads first, prologues in order; probes; rows."""

import math
import threading
import time

import numpy as np
import pytest

from kvtier.tiers.base import Failure, FailureKind
from kvtier.tiers.disk import blockio as blockio_module
from kvtier.tiers.disk.blockio import RowIO, aligned_buffer, probe_o_direct
from kvtier.tiers.disk.mover import Mover, MoverJob
from kvtier.tiers.cpu.region import SharedRegion


def job(job_id, n, block, is_load=False, before=None, after=None):
    return MoverJob(
        job_id,
        is_load,
        [bytes([i]) for i in range(n)],
        list(range(n)),
        block=block,
        before=before,
        after=after,
    )


def wait_for(mover, count, timeout=10.0):
    done, deadline = [], time.monotonic() + timeout
    while len(done) < count and time.monotonic() < deadline:
        done.extend(mover.poll())
        time.sleep(0.001)
    return done


def test_blocks_run_on_mover_threads_and_complete_once():
    caller = threading.get_ident()
    seen = []
    mover = Mover("t", threads=3)
    try:
        after_calls = []
        mover.submit(
            job(
                1,
                10,
                lambda j, i: seen.append(threading.get_ident()) or None,
                after=lambda j: after_calls.append(j.job_id),
            )
        )
        (done,) = wait_for(mover, 1)
        assert done.job_id == 1 and done.reasons == [None] * 10
        assert math.isfinite(done.seconds)  # the job's duration is reported
        assert len(seen) == 10 and caller not in seen
        assert after_calls == [1]
        assert mover.poll() == [] and mover.pending() == 0
    finally:
        mover.close()


def test_loads_run_before_queued_stores():
    order, gate = [], threading.Event()
    mover = Mover("t", threads=1)
    try:
        mover.submit(job(1, 1, lambda j, i: gate.wait(5) and None))  # occupies the only thread
        time.sleep(0.05)
        mover.submit(job(2, 2, lambda j, i: order.append("store") or None))
        mover.submit(job(3, 2, lambda j, i: order.append("load") or None, is_load=True))
        gate.set()
        wait_for(mover, 3)
        assert order == ["load", "load", "store", "store"]
    finally:
        mover.close()


def test_prologues_run_in_submission_order_and_may_settle_keys():
    order = []

    def before(j):
        order.append(j.job_id)
        j.reasons[0] = Failure.FULL
        j.skip[1] = True

    ran = []
    mover = Mover("t", threads=4)
    try:
        for job_id in range(1, 21):
            mover.submit(job(job_id, 3, lambda j, i: ran.append((j.job_id, i)) or None, before=before))
        done = wait_for(mover, 20)
        assert order == list(range(1, 21))
        assert sorted(ran) == [(job_id, 2) for job_id in range(1, 21)]
        assert all(j.reasons == [Failure.FULL, None, None] for j in done)
    finally:
        mover.close()


def test_a_bug_in_a_block_fails_only_that_key(caplog):
    def block(j, i):
        if i == 1:
            raise RuntimeError("boom")

    mover = Mover("t", threads=2)
    try:
        mover.submit(job(1, 3, block))
        (done,) = wait_for(mover, 1)
        assert done.reasons == [None, Failure(FailureKind.UNEXPECTED, detail="RuntimeError"), None]
        assert "boom" in caplog.text
        mover.submit(job(2, 1, lambda j, i: None))  # the thread survived
        assert wait_for(mover, 1)[0].reasons == [None]
    finally:
        mover.close()


def test_wait_idle_and_close_are_idempotent():
    mover = Mover("t", threads=2)
    mover.submit(job(1, 4, lambda j, i: time.sleep(0.01)))
    assert mover.wait_idle(5)
    assert len(mover.poll()) == 1
    mover.close()
    mover.close()
    with pytest.raises(RuntimeError):
        mover.submit(job(2, 1, lambda j, i: None))


def test_probe_is_cached_per_directory(tmp_path, monkeypatch):
    first = probe_o_direct(str(tmp_path))
    calls = []
    monkeypatch.setattr(blockio_module, "_probe", lambda d: calls.append(d))
    assert probe_o_direct(str(tmp_path)) is first
    assert calls == []
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_rowio_on_cpu_tier_rows_allows_o_direct():
    region = SharedRegion.create(3, 10_000)
    try:
        rowio = RowIO(region.rows)
        assert rowio.direct_problem is None
        assert rowio.padded_bytes == 12288
        assert len(rowio.iov(2, True)) == 12288 and len(rowio.iov(2, False)) == 10_000
        rowio.iov(2, True)[:] = 7  # the last row's padding is inside the region
        assert (region.rows[2] == 7).all()
    finally:
        region.close()


def test_rowio_refuses_o_direct_on_unaligned_or_unpadded_rows():
    odd_stride = np.frombuffer(aligned_buffer(4 * 5000), dtype=np.uint8)[: 4 * 5000].reshape(4, 5000)
    assert "stride" in RowIO(odd_stride[:, :4000]).direct_problem
    plain = np.zeros((4, 10_000), dtype=np.uint8)
    assert RowIO(plain).direct_problem is not None
    buffer = aligned_buffer(4 * 8192)
    exact = np.frombuffer(buffer, dtype=np.uint8).reshape(4, 8192)
    assert RowIO(exact).direct_problem is None  # page multiple, page aligned
    unpadded = np.frombuffer(buffer, dtype=np.uint8)[: 3 * 10_000].reshape(3, 10_000)
    assert RowIO(unpadded).direct_problem is not None
    with pytest.raises(ValueError):
        RowIO(np.zeros((4, 4), dtype=np.int32))


def test_a_slow_epilogue_does_not_hold_the_io_threads():
    """A store job's flush runs on a finisher: with one I/O thread, a second job's blocks
    still run while the first job's epilogue waits."""
    release = threading.Event()
    second_ran = threading.Event()
    mover = Mover("t", threads=1)
    try:
        mover.submit(job(1, 2, lambda j, i: None, after=lambda j: release.wait(10)))
        mover.submit(job(2, 2, lambda j, i: second_ran.set()))
        assert second_ran.wait(10)  # the only I/O thread was free while job 1 flushed
        assert [j.job_id for j in wait_for(mover, 1)] == [2]
        release.set()
        assert [j.job_id for j in wait_for(mover, 1)] == [1]
    finally:
        release.set()
        mover.close()


def test_wait_loads_returns_while_a_store_is_still_running():
    """A promotion's reader waits for the loads only: a stalled store's flush does not hold it,
    and wait_idle still waits for that store."""
    release = threading.Event()
    mover = Mover("t", threads=2)
    try:
        mover.submit(job(1, 2, lambda j, i: None, after=lambda j: release.wait(10)))
        mover.submit(job(2, 3, lambda j, i: None, is_load=True))
        assert mover.wait_loads(timeout_s=10)
        assert mover.pending() == 1  # the store is still in flight
        assert [j.job_id for j in wait_for(mover, 1)] == [2]
        assert not mover.wait_idle(timeout_s=0.05)
        release.set()
        assert mover.wait_idle(timeout_s=10)
        assert [j.job_id for j in mover.poll()] == [1]
    finally:
        release.set()
        mover.close()


def test_wait_loads_times_out_while_a_load_is_stuck():
    gate = threading.Event()
    mover = Mover("t", threads=1)
    try:
        mover.submit(job(1, 1, lambda j, i: gate.wait(10) and None, is_load=True))
        assert not mover.wait_loads(timeout_s=0.05)
        gate.set()
        assert mover.wait_loads(timeout_s=10)
        assert [j.job_id for j in wait_for(mover, 1)] == [1]
    finally:
        gate.set()
        mover.close()


def test_stores_waiting_while_store_blocks_wait_for_a_thread():
    """What a files tier's flush asks before it gathers: true only while store blocks queue."""
    entered, gate = threading.Event(), threading.Event()
    mover = Mover("t", threads=1)
    try:
        assert not mover.stores_waiting()

        def block(j, i):
            entered.set()
            gate.wait(10)

        mover.submit(job(1, 3, block))
        assert entered.wait(10)  # the only thread holds block 0; blocks 1 and 2 queue
        assert mover.stores_waiting()
        gate.set()
        assert mover.wait_idle(timeout_s=10)
        assert not mover.stores_waiting()
    finally:
        gate.set()
        mover.close()

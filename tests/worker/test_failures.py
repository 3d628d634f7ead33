"""FailedRowMarks: a worker's failed store reaches the scheduler side through shared memory."""

from __future__ import annotations

import os
import uuid

import pytest

from kvtier import KvtierError
from kvtier.tiers.cpu.region import default_directory
from kvtier.worker.failures import FailedRowMarks, marks_path


def test_a_mark_set_by_a_worker_is_taken_once_by_the_scheduler_side():
    path = os.path.join(default_directory(), f"kvtier-test-{uuid.uuid4().hex}")
    scheduler = FailedRowMarks.create(path, 16)
    worker = FailedRowMarks.attach(path, timeout_s=0)  # another mapping of the same bytes
    try:
        worker.mark([3, 9])
        assert scheduler.take([2, 3, 9]).tolist() == [False, True, True]
        assert scheduler.take([3, 9]).tolist() == [False, False]  # taken: cleared
        worker.mark([5])
        scheduler.clear()
        assert not scheduler.take(range(16)).any()
    finally:
        worker.close()
        scheduler.close()
    assert not os.path.exists(marks_path(path))


def test_attaching_to_marks_nobody_created_names_the_path():
    path = os.path.join(default_directory(), f"kvtier-test-{uuid.uuid4().hex}")
    with pytest.raises(KvtierError, match="failed"):
        FailedRowMarks.attach(path, timeout_s=0)

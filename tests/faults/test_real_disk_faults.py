"""Real ENOSPC, EROFS and EIO under a running CPU + disk stack, for both disk kinds.

Nothing here is mocked: the faults come from real filesystems (root only; the tests skip,
saying why, where mounting is not permitted).

* **ENOSPC**: the disk tier lives on a 4 MiB tmpfs that another file fills while the stack
  runs; the filler is removed afterwards.
* **EROFS**: ``mount -o remount,ro`` cannot do it while the engine runs — the kernel refuses
  with EBUSY as long as any file on the filesystem is open for writing, and both tiers keep
  theirs open. The store therefore lives on ext4 (a loop device) mounted
  ``errors=remount-ro``, and the filesystem is made to hit an error of its own
  (``/sys/fs/ext4/<dev>/trigger_fs_error``): the kernel turns it read-only under the open
  files, as it does on a real disk error. ext4 then stays read-only until unmounted and
  repaired, so recovery is a restart: shut down, ``e2fsck``, mount, build the stack again.
* **EIO**: no device-mapper here (no ``error`` target), so the same ext4 is stopped with
  ``EXT4_IOC_SHUTDOWN`` (what ``xfs_io -c shutdown`` does): from then on every read, write,
  open and flush on it is EIO from the kernel, the way a failed device behaves. This is the
  syscall boundary itself failing, for every path and descriptor of the store, with no
  Python function patched. Recovery is again a restart.

Each test checks: the failing stores fail with that errno (counted by the tier and by the
manager, equal counts), CPU hits keep being served byte for byte, disk hits keep being
served (ENOSPC, EROFS) or are counted misses (EIO: reads fail too), nothing committed before
the fault is lost (served byte-exact after recovery), the store checks healthy, and stores
succeed again once the fault is gone.
"""

from __future__ import annotations

import os

import pytest
from kvtier_testing.fault_fs import ext4, fill, fs_error, remount, shutdown, tmpfs
from kvtier_testing.fault_stack import CTX, Stack
from kvtier_testing import key

from kvtier.tiers.disk import check_store

KINDS = ("lmdb", "files")


def keys(start: int, count: int):
    return [key(i) for i in range(start, start + count)]


def store_in_jobs(stack: Stack, new, per_job: int = 8) -> None:
    """Several demotion jobs, so an index that grows page by page (lmdb) meets the fault."""
    for first in range(0, len(new), per_job):
        stack.store(new[first : first + per_job])


def assert_failures_counted(stack: Stack, failed, name: str) -> None:
    stats = stack.stats()
    assert stats[f"disk.failed_{name}"] == len(failed), stats
    assert stats["disk.demote_failures"] == len(failed)
    assert stats["disk.failed_keys"] == len(failed)
    assert stats["disk.corrupt"] == 0
    assert all(stack.disk.lookup(k) is False for k in failed)


def assert_committed_served(kind: str, path, committed, wrong_ok: bool = False) -> None:
    """A new stack on ``path`` serves every committed block byte for byte; the store is healthy."""
    stack = Stack(kind, path)
    try:
        served, wrong = stack.disk_hits(committed)
        assert wrong == 0
        assert served == committed
        assert stack.stats()["disk.promote_failures"] == 0
    finally:
        stack.shutdown()
    report = check_store(str(path))
    assert report.healthy, report.problems


@pytest.mark.parametrize("kind", KINDS)
def test_a_filesystem_filled_while_running(kind, tmp_path):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        store = mnt / "store"
        stack = Stack(kind, store)
        try:
            before = keys(0, 16)
            stack.store(before)
            assert stack.on_disk(before) == before

            filler = fill(mnt)  # another process takes every free byte
            during = keys(100, 48)
            store_in_jobs(stack, during)
            failed = [k for k in during if not stack.disk.lookup(k)]
            # lmdb preallocated its slab at open, so only its index growth can meet ENOSPC;
            # some of its jobs may still fit in index pages it already had
            assert failed
            assert_failures_counted(stack, failed, "ENOSPC")
            assert stack.cpu_hits(during) == 0  # refused blocks stay served from the CPU tier

            served, wrong = stack.disk_hits(before)  # hits from the full disk go on
            assert served == before and wrong == 0

            os.unlink(filler)  # room again: stores succeed again
            after = keys(200, 16)
            stack.store(after)
            assert stack.on_disk(after) == after
            report = stack.disk.check()  # while running: nothing leaked by the failed jobs
            assert report.healthy, report.problems
            committed = before + stack.on_disk(during) + after
        finally:
            stack.shutdown()
        assert_committed_served(kind, store, committed)


@pytest.mark.parametrize("kind", KINDS)
def test_a_filesystem_turned_read_only_while_running(kind, tmp_path):
    image = tmp_path / "ext4.img"
    with ext4(image, tmp_path / "mnt") as mnt:
        store = mnt / "store"
        stack = Stack(kind, store)
        try:
            before = keys(0, 16)
            stack.store(before)
            assert stack.on_disk(before) == before

            fs_error(mnt)  # the kernel remounts it read-only under the open files
            during = keys(100, 16)
            store_in_jobs(stack, during)
            assert stack.on_disk(during) == []
            assert_failures_counted(stack, during, "EROFS")
            assert stack.cpu_hits(during) == 0

            served, wrong = stack.disk_hits(before)  # reads still work on a read-only disk
            assert served == before and wrong == 0
        finally:
            stack.shutdown()
        remount(image, mnt)
        stack = Stack(kind, store)
        try:
            after = keys(200, 16)
            stack.store(after)  # writable again
            assert stack.on_disk(after) == after
        finally:
            stack.shutdown()
        assert_committed_served(kind, store, before + after)


@pytest.mark.parametrize("kind", KINDS)
def test_a_device_failing_with_eio_while_running(kind, tmp_path):
    image = tmp_path / "ext4.img"
    with ext4(image, tmp_path / "mnt") as mnt:
        store = mnt / "store"
        stack = Stack(kind, store)
        try:
            before = keys(0, 16)
            stack.store(before)
            assert stack.on_disk(before) == before

            shutdown(mnt)  # every I/O on the filesystem is EIO from now on
            during = keys(100, 16)
            store_in_jobs(stack, during)
            assert stack.on_disk(during) == []
            assert_failures_counted(stack, during, "EIO")
            assert stack.cpu_hits(during) == 0  # the CPU tier keeps serving

            served, wrong = stack.disk_hits(before)
            # a read that fails is a counted miss, never bytes; lmdb's index lives in its
            # map, so lookups still find the blocks, and their reads fail
            assert wrong == 0 and served == []
            stats = stack.stats()
            assert stats["disk.promote_failures"] == len(before)
            assert stats["disk.failed_EIO"] == len(during) + len(before)
            assert stats["disk.corrupt"] == 0

            # A read failing slower than a step is polled at the end of a step, not by a
            # lookup; the next lookup must still answer False, not queue it again (None):
            # else a request on a dying disk would wait for ever.
            manager, k = stack.manager, before[0]
            manager.on_schedule_end()
            assert manager.lookup(k, CTX) is None
            manager.on_schedule_end()  # submits the read
            stack.disk.drain_jobs()  # it fails
            manager.on_schedule_end()  # and the failure is polled here
            assert manager.lookup(k, CTX) is False
            assert stack.stats()["disk.promote_failures"] == len(before) + 1
        finally:
            stack.shutdown()
        remount(image, mnt)
        assert_committed_served(kind, store, before)

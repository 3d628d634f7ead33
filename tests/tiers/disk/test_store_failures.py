"""I/O failures fail the job's keys only: a counter and one log line say why, nothing committed is lost."""

import errno
import logging
import os
import shutil
import subprocess

import pytest
from kvtier_testing import key
from kvtier_testing.store import holds, load, open_tier, store

from kvtier.errors import ConfigError
from kvtier.tiers.base import Failure


def failing(real, code, when=lambda *args: True):
    def call(*args, **kwargs):
        if when(*args):
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    return call


def assert_committed_intact(tier, rows, keys):
    result = load(tier, rows, keys, first_row=40)
    assert result.ok == keys, result.failed
    assert all(holds(rows, 40 + i, k) for i, k in enumerate(keys))
    report = tier.check()
    assert report.healthy, report.problems


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EROFS, errno.EACCES])
def test_write_errors_fail_the_job_cleanly(kind, code, tmp_path, shm, monkeypatch, caplog):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 16)
    committed = [key(i) for i in range(4)]
    assert store(tier, shm.rows, committed).success
    tier.take_events()
    name = errno.errorcode[code]
    monkeypatch.setattr(os, "pwritev", failing(os.pwritev, code))
    new = [key(i) for i in range(10, 14)]
    with caplog.at_level(logging.WARNING):
        result = store(tier, shm.rows, new, first_row=10)
    assert result.failed == {k: Failure.os_error(code) for k in new} and not result.success
    assert all(tier.lookup(k) is False for k in new)
    assert not [e for e in tier.take_events() if not e.removed]  # nothing announced as stored
    assert tier.stats()[f"failed_{name}"] == 4
    lines = [r for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and "4 of 4 blocks failed" in lines[0].getMessage()
    monkeypatch.undo()
    assert_committed_intact(tier, shm.rows, committed)
    assert store(tier, shm.rows, new, first_row=10).success  # the room was given back
    tier.close()


def test_a_failure_midway_fails_only_the_blocks_it_hit(kind, tmp_path, shm, monkeypatch):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 16, threads=1)
    calls = []

    def every_other(*args):
        calls.append(1)
        return len(calls) % 2 == 0

    monkeypatch.setattr(os, "pwritev", failing(os.pwritev, errno.ENOSPC, every_other))
    keys = [key(i) for i in range(6)]
    result = store(tier, shm.rows, keys)
    monkeypatch.undo()
    assert len(result.ok) == 3 and set(result.failed.values()) == {Failure.os_error(errno.ENOSPC)}
    assert_committed_intact(tier, shm.rows, result.ok)
    tier.close()


def test_read_errors_fail_the_load_but_keep_the_block(kind, tmp_path, shm, monkeypatch):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(3)]
    store(tier, shm.rows, keys)
    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.EIO))
    result = load(tier, shm.rows, keys, first_row=20)
    assert result.failed == {k: Failure.os_error(errno.EIO) for k in keys}
    monkeypatch.undo()
    assert all(tier.lookup(k) for k in keys)  # an I/O error is not evidence of a bad block
    assert_committed_intact(tier, shm.rows, keys)
    tier.close()


def test_flush_failure_fails_the_job(kind, tmp_path, shm, monkeypatch):
    """fsync: always flushes each block; a failing flush must not report the block stored."""
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, fsync="always")
    committed = [key(1)]
    store(tier, shm.rows, committed)
    monkeypatch.setattr(os, "fdatasync", failing(os.fdatasync, errno.EIO))
    result = store(tier, shm.rows, [key(2)], first_row=2)
    monkeypatch.undo()
    assert result.failed == {key(2): Failure.os_error(errno.EIO)} and tier.lookup(key(2)) is False
    assert_committed_intact(tier, shm.rows, committed)
    tier.close()


# -- real filesystems (root only: mounting needs privileges) --------------------------------------


def mount_tmpfs(path, size):
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def tiny_fs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mount_tmpfs(mnt, "1m")
    yield mnt
    umount(mnt)


def test_a_full_filesystem_fails_jobs_cleanly(kind, tiny_fs, shm, caplog):
    tier = open_tier(kind, tiny_fs / "s", shm.rows, 24, o_direct="auto")
    committed = [key(i) for i in range(3)]
    assert store(tier, shm.rows, committed).success
    # someone else fills the disk
    with open(tiny_fs / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    new = [key(i) for i in range(10, 30)]
    results = [store(tier, shm.rows, new[i : i + 4], first_row=10) for i in range(0, 20, 4)]
    failed = {k: r for result in results for k, r in result.failed.items()}
    ok = [k for result in results for k in result.ok]
    # (lmdb preallocated its slab at open, so there a full disk hits the index's growth)
    assert failed and {r.errno for r in failed.values()} == {errno.ENOSPC}
    assert all(tier.lookup(k) is False for k in failed)
    os.unlink(tiny_fs / "filler")
    assert_committed_intact(tier, shm.rows, committed + ok)
    tier.close()


def test_capacity_beyond_the_filesystem_opens_and_counts_the_stores_it_cannot_take(
    kind, tiny_fs, shm, caplog
):
    """A node restarted while its disk is briefly full: a capacity beyond the room opens with
    one warning (not an error: that is `kvtier config check`'s); stores that find the disk
    full fail as ENOSPC, counted; once the room is back, they are taken; nothing stored is
    lost."""
    filler = tiny_fs / "filler"
    filler.write_bytes(b"\xa5" * (600 << 10))  # another program's file: 400 KiB stay free
    with caplog.at_level(logging.WARNING):
        tier = open_tier(kind, tiny_fs / "s", shm.rows, 48)  # 48 blocks of 16 KiB on disk
    warned = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(warned) == 1 and "free there" in warned[0] and "config check" in warned[0]
    assert tier.stats()["short_bytes"] > 0
    keys = [key(i) for i in range(48)]
    results = [store(tier, shm.rows, keys[n : n + 8], first_row=n) for n in range(0, 48, 8)]
    ok = [k for result in results for k in result.ok]
    failed = [k for result in results for k in result.failed]
    assert ok and failed
    assert {r.errno for result in results for r in result.failed.values()} == {errno.ENOSPC}
    assert tier.stats()["failed_keys"] == len(failed)
    assert all(tier.lookup(k) is False for k in failed)
    os.unlink(filler)  # the disk has room again
    again = [
        store(tier, shm.rows, failed[n : n + 8], first_row=keys.index(failed[n]))
        for n in range(0, len(failed), 8)
    ]
    assert [k for result in again for k in result.ok] == failed
    assert_committed_intact(tier, shm.rows, keys[:8])
    tier.close()


def test_read_only_filesystem_is_an_open_error(kind, tiny_fs, shm):
    """A store on a filesystem mounted read-only: refused at open, naming the cause and the fix.

    (A filesystem cannot be remounted read-only under an open tier — the kernel refuses while
    files are open for writing — so EROFS while running is covered by injection above.)
    """
    tier = open_tier(kind, tiny_fs / "s", shm.rows, 16)
    store(tier, shm.rows, [key(1)])
    tier.close()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    try:
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*read-only filesystem.*remount"):
            open_tier(kind, tiny_fs / "s", shm.rows, 16)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_fs)], check=True)
    tier = open_tier(kind, tiny_fs / "s", shm.rows, 16)
    assert load(tier, shm.rows, [key(1)], first_row=40).ok == [key(1)]
    tier.close()

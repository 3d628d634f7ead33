"""What only the files tier has: names, temp files, the shared count, the recency log."""

import errno
import fcntl
import os
import struct
import tempfile
import time

import pytest
from kvtier_testing import key
from kvtier_testing.store import dead_pid, holds, load, open_tier, store

from kvtier.bench.disk import _filesystem
from kvtier.tiers.base import Failure
from kvtier.tiers.disk.syscalls import spread_subdirectories


def usage(path) -> int:
    return int.from_bytes((path / "usage").read_bytes()[:8], "little")


def test_layout_one_file_per_block(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(3)]
    store(tier, shm.rows, keys)
    names = sorted(p.name for p in (tmp_path / "s" / "blocks").rglob("*.kvb"))
    assert names == sorted(k.hex() + ".kvb" for k in keys)
    sizes = {p.stat().st_size for p in (tmp_path / "s" / "blocks").rglob("*.kvb")}
    assert sizes <= {tier.slot_bytes, 4096 + tier.block_bytes}
    assert usage(tmp_path / "s") == 3
    tier.close()


def test_temp_files_of_dead_writers_are_removed(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    store(tier, shm.rows, [key(1)])
    subdir = os.path.dirname(tier._shown(tier._path_of(key(2), 0)))
    temp = os.path.join(subdir, f".{key(2).hex()}.{dead_pid()}.1.tmp")
    with open(temp, "wb") as f:
        f.write(b"half a block")
    report = tier.check()
    assert report.problems == [f"{temp}: temp file of a writer that is gone"]
    tier.close()
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)  # alone: cleans at open
    assert not os.path.exists(temp) and tier.check().healthy
    assert tier.lookup(key(2)) is False and tier.num_blocks() == 1
    tier.close()


def test_check_finds_strays_misplaced_blocks_and_a_low_count(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(3)]
    store(tier, shm.rows, keys)
    blocks = tmp_path / "s" / "blocks"
    (blocks / "00" / "README").write_text("not a block")
    right = tier._shown(tier._path_of(keys[0], 0))
    wrong_dir = next(tier._shown(d) for d in tier._subdirs if tier._shown(d) != os.path.dirname(right))
    os.rename(right, os.path.join(wrong_dir, os.path.basename(right)))
    (tmp_path / "s" / "usage").write_bytes((1).to_bytes(8, "little"))
    report = tier.check(fix=True)
    text = "\n".join(report.problems)
    assert "README: not a block file" in text and "wrong fan-out directory" in text
    assert "usage count says 1 blocks, but 3 are on disk" in text
    assert tier.check().healthy
    assert usage(tmp_path / "s") == 2 and tier.lookup(keys[0]) is False
    assert load(tier, shm.rows, keys[1:], first_row=20).success
    tier.close()


def test_the_count_is_recounted_when_alone_and_bounds_capacity(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 4)
    store(tier, shm.rows, [key(i) for i in range(4)])
    tier.close()
    (tmp_path / "s" / "usage").write_bytes((99).to_bytes(8, "little"))  # drifted high by crashes
    tier = open_tier("files", tmp_path / "s", shm.rows, 4)
    assert usage(tmp_path / "s") == 4
    assert store(tier, shm.rows, [key(9)], first_row=9).success  # evicts one
    assert usage(tmp_path / "s") == 4
    assert len(list((tmp_path / "s" / "blocks").rglob("*.kvb"))) == 4
    tier.close()


def test_a_torn_recency_log_is_only_a_hint(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 3)
    keys = [key(i) for i in range(4)]
    for i in range(3):
        store(tier, shm.rows, [keys[i]], first_row=i)
    tier.close()
    with open(tmp_path / "s" / "recency.log", "ab") as log:
        log.write(b"\x01\x02\x03 torn")
    tier = open_tier("files", tmp_path / "s", shm.rows, 3)
    assert tier.num_blocks() == 3
    tier.take_events()
    store(tier, shm.rows, [keys[3]], first_row=3)
    assert [k for e in tier.take_events() if e.removed for k in e.keys] == [keys[0]]
    tier.close()


def test_publish_never_replaces_a_published_block(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 4)
    store(tier, shm.rows, [key(1)])
    final = tier._path_of(key(1), 0)  # relative to blocks/, as the tier names them
    with open(tier._shown(final), "rb") as f:
        before = f.read()
    temp = final + ".other.tmp"
    with open(tier._shown(temp), "wb") as f:
        f.write(b"a copy another process wrote")
    assert tier._publish(temp, final) is False
    assert not os.path.exists(tier._shown(temp))
    with open(tier._shown(final), "rb") as f:
        assert f.read() == before
    tier.close()


def test_group_flush_shares_a_flush_begun_after_each_caller_asked():
    """Callers asking while a flush runs wait for the next one, which serves them all; no
    caller returns on a flush that began before it asked."""
    import threading

    from kvtier.tiers.disk.group_flush import GroupFlush as _GroupFlush

    started: list[int] = []
    finished: list[int] = []
    release = threading.Event()
    entered = threading.Event()

    def flush():
        started.append(len(started) + 1)
        entered.set()
        if len(started) == 1:
            release.wait(10)  # hold the first flush while others ask
        finished.append(started[-1])

    group = _GroupFlush(flush)
    returned: dict[int, int] = {}  # caller -> flushes finished when it returned

    def caller(index):
        group.flush()
        returned[index] = len(finished)

    first = threading.Thread(target=caller, args=(0,))
    first.start()
    assert entered.wait(10)
    others = [threading.Thread(target=caller, args=(i,)) for i in range(1, 6)]
    for thread in others:
        thread.start()
    release.set()
    for thread in (first, *others):
        thread.join(10)
    assert started == [1, 2]  # six callers, two flushes: the five late ones shared the second
    assert returned[0] >= 1
    # the late callers asked while flush 1 ran (it may have begun before their blocks were
    # published): each returned only after flush 2 had finished
    assert [returned[i] for i in range(1, 6)] == [2] * 5


def test_group_flush_gathers_the_callers_of_a_busy_tier_into_one_flush():
    """While busy() says more blocks queue, the flush about to start waits for them and the
    callers asking meanwhile share it: one flush for five callers, where without gathering
    the first caller's flush starts at once and the four later ones need a second."""
    import threading

    from kvtier.tiers.disk.group_flush import GroupFlush as _GroupFlush

    busy = threading.Event()
    busy.set()
    flushes: list[bool] = []  # each flush: whether the tier was still busy when it began
    group = _GroupFlush(lambda: flushes.append(busy.is_set()), busy=busy.is_set, gather_s=3600)
    first = threading.Thread(target=group.flush)
    first.start()
    others = [threading.Thread(target=group.flush) for _ in range(4)]
    for thread in others:
        thread.start()
    # the four wait on the flush's condition for good; the gathering caller joins them
    # between its polls: all five waiting means all five asked before the flush began
    deadline = time.monotonic() + 10
    while len(group._cond._waiters) < 5 and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.001)
    assert flushes == []  # nothing flushed while the tier was busy
    busy.clear()
    for thread in (first, *others):
        thread.join(10)
        assert not thread.is_alive()
    assert flushes == [False]


def test_group_flush_gathers_for_gather_s_at_most_and_never_when_idle():
    """A tier busy for ever still gets its flush (after gather_s); an idle one at once."""
    import threading

    from kvtier.tiers.disk.group_flush import GroupFlush as _GroupFlush

    flushes: list[int] = []
    for busy in (lambda: True, lambda: False):
        group = _GroupFlush(lambda: flushes.append(1), busy=busy, gather_s=0.01)
        caller = threading.Thread(target=group.flush)
        caller.start()
        caller.join(10)
        assert not caller.is_alive()
    assert flushes == [1, 1]
    # an idle tier never waits, however long gather_s is
    group = _GroupFlush(lambda: flushes.append(1), busy=lambda: False, gather_s=3600)
    caller = threading.Thread(target=group.flush)
    caller.start()
    caller.join(10)
    assert not caller.is_alive() and flushes == [1, 1, 1]


def test_group_flush_serves_a_ticket_with_the_first_flush_begun_after_it():
    """A job whose blocks were all published before a flush began is covered by that flush,
    even if it asks while it runs: it returns when that one ends, not after another. A
    ticket taken after the flush began needs the next; one too old for its outcome to be
    known gets a fresh one."""
    import threading

    from kvtier.tiers.disk.group_flush import GroupFlush as _GroupFlush

    started: list[int] = []
    gates = {1: threading.Event(), 2: threading.Event()}
    entered = {1: threading.Event(), 2: threading.Event()}

    def flush():
        number = len(started) + 1
        started.append(number)
        if number in gates:
            entered[number].set()
            gates[number].wait(10)

    group = _GroupFlush(flush)
    before = group.ticket()  # blocks published, then flush 1 begins
    first = threading.Thread(target=group.flush)
    first.start()
    assert entered[1].wait(10)
    after = group.ticket()  # published while flush 1 runs
    covered = threading.Thread(target=group.flush, args=(before,))
    late = threading.Thread(target=group.flush, args=(after,))
    covered.start()
    late.start()
    gates[1].set()
    assert entered[2].wait(10)  # the late ticket's flush has begun, and is held
    covered.join(10)
    assert not covered.is_alive()  # served by flush 1, while flush 2 still runs
    assert late.is_alive()
    gates[2].set()
    for thread in (first, late):
        thread.join(10)
        assert not thread.is_alive()
    assert started == [1, 2]
    # a ticket from 70 flushes ago: whether the flush after it failed is no longer known
    for _ in range(70):
        group.flush()
    count = len(started)
    group.flush(before)
    assert len(started) == count + 1


def test_group_flush_reports_a_failed_flush_to_its_callers_only():
    import errno

    import pytest

    from kvtier.tiers.disk.group_flush import GroupFlush as _GroupFlush

    outcomes = iter([OSError(errno.EIO, "flush failed"), None])

    def flush():
        error = next(outcomes)
        if error is not None:
            raise error

    group = _GroupFlush(flush)
    with pytest.raises(OSError) as info:
        group.flush()
    assert info.value.errno == errno.EIO
    group.flush()  # the next flush succeeds, and so does its caller


def test_a_batch_job_is_flushed_once_and_counted(tmp_path, shm):
    tier = open_tier("files", tmp_path / "s", shm.rows, 8, fsync="batch")
    store(tier, shm.rows, [key(i) for i in range(4)])
    flushes = tier.stats().get("flushes", 0)
    assert flushes == 1  # one syncfs for the whole job, none per block
    tier.close()


def test_a_block_written_costs_no_stat_and_no_fstat(tmp_path, shm, monkeypatch):
    """Each system call on the writer threads hands the GIL round them: a block is an open,
    a write, a close and a rename (docs/design/disk.md), not also a stat to see whether
    another process published the key and an fstat of a file the tier just created."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 64, threads=4)
    calls = []
    for name in ("stat", "fstat", "lstat"):
        real = getattr(os, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, counted)
    keys = [key(i) for i in range(32)]
    result = store(tier, shm.rows, keys)
    monkeypatch.undo()
    assert result.ok == keys
    assert calls == []
    assert sorted(p.name for p in (tmp_path / "s" / "blocks").rglob("*.kvb")) == sorted(
        k.hex() + ".kvb" for k in keys
    )
    tier.close()


def test_a_key_published_by_another_process_meanwhile_takes_no_room(tmp_path, shm):
    """No stat before writing: a block published behind this process's back (here: a block
    of its own it forgot, as a file another process wrote would be) is found by the rename,
    which refuses to replace it; the store succeeds and its room goes back to the count."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    store(tier, shm.rows, [key(1)])
    tier._forget([key(1)])  # the file stays: to this process it is someone else's now
    assert tier.lookup(key(1)) is False
    result = store(tier, shm.rows, [key(1), key(2)], first_row=1)
    assert result.ok == [key(1), key(2)]
    assert usage(tmp_path / "s") == 2  # key(1) counted once, though written twice
    assert load(tier, shm.rows, [key(1), key(2)], first_row=20).ok == [key(1), key(2)]
    tier.close()


def _flags(path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, 0x80086601, b"\0" * 4))[0]  # FS_IOC_GETFLAGS
    finally:
        os.close(fd)


def test_fan_out_directories_are_made_apart_on_ext4(tmp_path, shm):
    """On ext4 a file's inode comes from its directory's block group, and without a journal
    each creation steps over every inode freed there lately: fan-out directories made next to
    their parent shared /var/tmp's group and its churn (0.8 ms of kernel CPU a file). blocks/
    is marked as the top of a hierarchy, so its fan-out directories go to groups apart."""
    if _filesystem(str(tmp_path)) not in ("ext2", "ext3", "ext4"):
        pytest.skip("block groups and the top-directory flag are ext2/3/4's")
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    blocks = tmp_path / "s" / "blocks"
    assert _flags(blocks) & 0x00020000  # FS_TOPDIR_FL
    inodes = sorted(os.stat(blocks / f"{i:02x}").st_ino for i in range(256))
    # made next to their parent, 256 directories take 256 neighbouring inodes; apart, they
    # span groups (each of thousands of inodes)
    assert inodes[-1] - inodes[0] > 100 * 256
    keys = [key(i) for i in range(8)]
    assert store(tier, shm.rows, keys).ok == keys
    assert load(tier, shm.rows, keys, first_row=20).ok == keys
    tier.close()
    # an existing store keeps its flag and its blocks
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)
    assert _flags(blocks) & 0x00020000 and tier.num_blocks() == 8
    tier.close()


def test_spreading_is_skipped_where_the_filesystem_has_no_such_flag():
    """tmpfs has no block groups: the flag is refused, and the tier goes on without it."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert spread_subdirectories(fd) is False
        finally:
            os.close(fd)


def _extents(path) -> int:
    """How many extents the file at ``path`` has (FIEMAP, with no room for their list)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        query = struct.pack("=QQIIII", 0, 2**64 - 1, 1, 0, 0, 0)  # FIEMAP_FLAG_SYNC
        return struct.unpack("=QQIIII", fcntl.ioctl(fd, 0xC020660B, query))[3]  # FS_IOC_FIEMAP
    finally:
        os.close(fd)


def test_each_new_block_file_is_one_run_of_its_exact_size(tmp_path):
    """Written with O_DIRECT into an empty file, a 2 MiB block and its header page (513 file
    system blocks) were often allocated as 512 and, somewhere else, 1: two writes to the
    device for one block, and two reads to load it. Allocated ahead at its exact size, each
    file is one extent."""
    from kvtier_testing.store import region

    if _filesystem(str(tmp_path)) not in ("ext4", "xfs"):
        pytest.skip("extents as ext4 and XFS allocate them")
    rows = region(16, 2 << 20)
    try:
        tier = open_tier("files", tmp_path / "s", rows.rows, 16, threads=4)
        if not tier.o_direct:
            pytest.skip("O_DIRECT refused here")
        keys = [key(i) for i in range(16)]
        assert store(tier, rows.rows, keys).ok == keys
        files = sorted((tmp_path / "s" / "blocks").rglob("*.kvb"))
        assert len(files) == 16
        assert {f.stat().st_size for f in files} == {tier.slot_bytes}
        assert [_extents(f) for f in files] == [1] * 16
        rows.rows[:] = 0
        assert load(tier, rows.rows, keys).ok == keys  # verified, then compared below
        assert all(holds(rows.rows, i, k) for i, k in enumerate(keys))
        tier.close()
    finally:
        rows.close()


def test_a_filesystem_without_fallocate_is_asked_once(tmp_path, shm, monkeypatch):
    """Allocating ahead is a hint: refused (EOPNOTSUPP), the tier stops asking and stores as
    before; a refusal for want of room is left for the write itself to report."""
    import ctypes

    from kvtier.tiers.disk import files as files_module

    calls: list[int] = []

    def refused(fd, mode, offset, length):
        calls.append(length)
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(files_module, "fallocate", refused)
    tier = open_tier("files", tmp_path / "s", shm.rows, 8, threads=1)
    if not tier.o_direct:
        pytest.skip("allocating ahead goes with O_DIRECT writes")
    keys = [key(i) for i in range(8)]
    assert store(tier, shm.rows, keys).ok == keys
    assert calls == [tier.slot_bytes]  # asked once, for the block's whole file
    shm.rows[:] = 0
    assert load(tier, shm.rows, keys).ok == keys
    assert all(holds(shm.rows, i, k) for i, k in enumerate(keys))
    tier.close()


def _inodes(path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in (path / "blocks").rglob("*.kvb")}


@pytest.mark.parametrize("fsync", ["batch", "none", "always", "batch without syncfs"])
def test_a_full_store_writes_new_blocks_into_the_evicted_blocks_files(tmp_path, shm, fsync, monkeypatch):
    """A new block takes an evicted block's file, written over in place: no inode or extent
    is allocated or freed (no discard), as in a preallocated file; the bytes, the count and
    the store's health are as if the file were new, under every flush policy (without
    syncfs, as on other systems, `batch` flushes each file and publishes them at the end)."""
    if fsync == "batch without syncfs":
        monkeypatch.setattr("kvtier.tiers.disk.files.syncfs", None)
        fsync = "batch"
    tier = open_tier("files", tmp_path / "s", shm.rows, 8, fsync=fsync)
    old = [key(i) for i in range(8)]
    assert store(tier, shm.rows, old).ok == old
    before = _inodes(tmp_path / "s")
    new = [key(100 + i) for i in range(6)]
    assert store(tier, shm.rows, new, first_row=8).ok == new
    after = _inodes(tmp_path / "s")
    assert set(after) == {k.hex() + ".kvb" for k in old[6:] + new}
    assert {after[k.hex() + ".kvb"] for k in new} == {before[k.hex() + ".kvb"] for k in old[:6]}
    assert not [p for p in (tmp_path / "s" / "blocks").rglob(".*")]  # no temp file left
    assert usage(tmp_path / "s") == 8
    result = load(tier, shm.rows, new + old[6:], first_row=30)
    assert result.ok == new + old[6:]
    assert all(holds(shm.rows, 30 + i, k) for i, k in enumerate(new + old[6:]))
    assert load(tier, shm.rows, old[:1], first_row=50).ok == []
    assert tier.check().healthy
    tier.close()
    tier = open_tier("files", tmp_path / "s", shm.rows, 8)  # and after a restart
    assert sorted(tier._policy) == sorted(new + old[6:]) and usage(tmp_path / "s") == 8
    tier.close()


def test_a_reader_of_an_evicted_block_written_over_gets_a_miss_never_the_new_block(tmp_path, shm):
    """Another process may hold the evicted block's file open while a new block is written
    into it: what it reads then names another key (or fails its checksum), so it fails
    verification as the evicted key; read as the new key, it is the new block."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 1)
    assert store(tier, shm.rows, [key(1)]).ok == [key(1)]
    fd = os.open(tier._shown(tier._path_of(key(1), 0)), os.O_RDONLY)
    try:
        assert store(tier, shm.rows, [key(2)], first_row=1).ok == [key(2)]
        assert os.fstat(fd).st_ino == os.stat(tier._shown(tier._path_of(key(2), 0))).st_ino
        failure = tier._io.read(fd, 0, key(1), 10, False)
        assert failure is not None and failure.kind.name == "CORRUPT"
        assert tier._io.read(fd, 0, key(2), 11, False) is None and holds(shm.rows, 11, key(2))
    finally:
        os.close(fd)
    tier.close()


def test_a_failed_write_into_an_evicted_blocks_file_gives_its_room_back(tmp_path, shm, monkeypatch):
    """The evicted file is removed with the failed block, and its room with it: the count
    says what is on disk, and the other keys of the job are stored."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 4)
    old = [key(i) for i in range(4)]
    assert store(tier, shm.rows, old).ok == old
    real = tier._io.write

    def write(fd, offset, k, row, direct):
        if k == key(101):
            raise OSError(errno.EIO, "injected")
        return real(fd, offset, k, row, direct)

    monkeypatch.setattr(tier._io, "write", write)
    new = [key(100 + i) for i in range(4)]
    result = store(tier, shm.rows, new, first_row=8)
    assert result.ok == [k for k in new if k != key(101)] and list(result.failed) == [key(101)]
    assert len(_inodes(tmp_path / "s")) == 3 == usage(tmp_path / "s")
    assert not [p for p in (tmp_path / "s" / "blocks").rglob(".*")]
    assert tier.check().healthy
    tier.close()


def test_an_o_direct_write_refused_over_an_evicted_blocks_file_is_retried_buffered_in_it(
    tmp_path, shm, monkeypatch
):
    """A filesystem that refuses an O_DIRECT write (EINVAL) turns O_DIRECT off for the tier
    and the write is retried buffered: into the same evicted file, which the first try kept."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 2)
    old = [key(1), key(2)]
    assert store(tier, shm.rows, old).ok == old
    if not tier.o_direct:
        pytest.skip("this filesystem takes no O_DIRECT")
    before = _inodes(tmp_path / "s")
    real = tier._io.write

    def write(fd, offset, k, row, direct):
        if direct:
            raise OSError(errno.EINVAL, "injected")
        return real(fd, offset, k, row, direct)

    monkeypatch.setattr(tier._io, "write", write)
    new = [key(3), key(4)]
    assert store(tier, shm.rows, new, first_row=4).ok == new
    assert not tier.o_direct
    after = _inodes(tmp_path / "s")
    assert sorted(after.values()) == sorted(before.values()) and usage(tmp_path / "s") == 2
    assert load(tier, shm.rows, new, first_row=20).ok == new
    assert holds(shm.rows, 20, key(3)) and holds(shm.rows, 21, key(4))
    assert tier.check().healthy
    tier.close()


def test_a_damaged_read_never_drops_the_block_now_written_into_that_file(tmp_path, shm):
    """A reader whose read failed because its file was reused meanwhile (evicted, written
    over, and back under the same name for a new copy of its key) must not remove what is
    there now: the same inode, but its ctime is newer than what the reader saw."""
    tier = open_tier("files", tmp_path / "s", shm.rows, 1)
    assert store(tier, shm.rows, [key(1)]).ok == [key(1)]
    fd = os.open(tier._shown(tier._path_of(key(1), 0)), os.O_RDONLY)
    try:
        assert store(tier, shm.rows, [key(2)], first_row=1).ok == [key(2)]  # key(1)'s file, reused
        seen = os.fstat(fd)  # what a reader of key(1) that read key(2)'s bytes has
        time.sleep(0.02)  # past a coarse clock's tick
        assert store(tier, shm.rows, [key(1)], first_row=2).ok == [key(1)]  # the same file again
        assert os.stat(tier._shown(tier._path_of(key(1), 0))).st_ino == seen.st_ino
    finally:
        os.close(fd)
    assert tier._drop(key(1), 0, seen, Failure.corrupt("key")) == Failure.MISSING
    assert load(tier, shm.rows, [key(1)], first_row=10).ok == [key(1)] and holds(shm.rows, 10, key(1))
    tier.close()

"""The drive under a store path and its write counter, on this machine's real ``/sys``."""

import os
from pathlib import Path

import pytest

from kvtier.tiers.disk.wear import (
    SECTOR_BYTES,
    DeviceWriteCounter,
    block_device_dir,
    filesystem_bytes,
    sectors_written,
)

SYS_BLOCK = Path("/sys/block")


def real_stat_files():
    return sorted(SYS_BLOCK.glob("*/stat")) if SYS_BLOCK.is_dir() else []


@pytest.mark.skipif(not real_stat_files(), reason="no /sys/block here")
def test_parser_reads_every_real_stat_file():
    for stat in real_stat_files():
        text = stat.read_text()
        fields = text.split()
        assert sectors_written(text) == int(fields[6])
        assert sectors_written(text) >= 0


def test_parser_refuses_what_is_not_a_stat_line():
    assert sectors_written(" 1 2 3 4 5 6 77 8 9 10 11\n") == 77
    for bad in ("", "1 2 3", "a b c d e f g h", "1 2 3 4 5 6 -7 8"):
        with pytest.raises(ValueError):
            sectors_written(bad)


def test_the_root_disk_is_found_and_counts_a_written_file(tmp_path):
    root = block_device_dir("/")
    if root is None:
        pytest.skip("/ is on no block device /sys shows (an overlay or tmpfs root)")
    assert (root / "stat").is_file()
    assert not (root / "partition").exists()  # a whole drive, never a partition
    assert (Path("/sys/block") / root.name).exists()
    # the store's own directory: a counter that moves when the test writes and syncs a file
    counter = DeviceWriteCounter.for_path(tmp_path)
    if counter is None or block_device_dir(tmp_path) != root:
        pytest.skip("the test's tmp_path is not on the root disk")
    before = counter.written_bytes()
    data = os.urandom(1 << 20)
    with open(tmp_path / "blob", "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    after = counter.written_bytes()
    assert before is not None and after is not None
    assert after - before >= len(data)  # other writers may add more, never less
    assert (after - before) % SECTOR_BYTES == 0
    assert filesystem_bytes(tmp_path) > len(data)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_a_tmpfs_path_has_no_drive():
    assert os.major(os.stat("/dev/shm").st_dev) == 0  # tmpfs: an anonymous device
    assert block_device_dir("/dev/shm") is None
    assert DeviceWriteCounter.for_path("/dev/shm") is None


def test_a_missing_path_has_no_drive(tmp_path):
    assert block_device_dir(tmp_path / "absent") is None


def fake_sys(tmp_path, path):
    """A /sys tree in which ``path``'s device is partition nvme0n1p2 of drive nvme0n1,
    behind a dm-crypt device; the drive's stat says 1000 sectors written."""
    dev = os.stat(path).st_dev
    sys_root = tmp_path / "sys"
    drive = sys_root / "devices" / "pci0000:00" / "nvme" / "nvme0n1"
    part = drive / "nvme0n1p2"
    part.mkdir(parents=True)
    (part / "partition").write_text("2\n")
    (part / "stat").write_text("1 0 8 0 5 0 40 0 0 0 0\n")
    (drive / "stat").write_text("10 0 80 0 50 0 1000 0 0 0 0\n")
    crypt = sys_root / "devices" / "virtual" / "block" / "dm-0"
    (crypt / "slaves").mkdir(parents=True)
    (crypt / "slaves" / "nvme0n1p2").symlink_to(part)
    (crypt / "stat").write_text("1 0 8 0 5 0 40 0 0 0 0\n")
    (sys_root / "dev" / "block").mkdir(parents=True)
    (sys_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(crypt)
    return sys_root, drive


def test_a_partition_behind_device_mapper_counts_as_its_drive(tmp_path):
    sys_root, drive = fake_sys(tmp_path, tmp_path)
    assert block_device_dir(tmp_path, str(sys_root)) == drive.resolve()
    counter = DeviceWriteCounter.for_path(tmp_path, str(sys_root))
    assert counter is not None and counter.device == "nvme0n1"
    assert counter.written_bytes() == 1000 * SECTOR_BYTES
    (drive / "stat").write_text("garbled\n")
    assert counter.written_bytes() is None  # unreadable now: the budget counts its own

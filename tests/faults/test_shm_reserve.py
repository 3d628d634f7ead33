"""The CPU tier's shared region reserves its pages at creation: a /dev/shm without room is a
ConfigError at start, and one filled after start can no longer kill the engine with SIGBUS.

Real tmpfs mounts stand in for /dev/shm (the CPU tier's ``path`` puts the region there);
root only, skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from kvtier_testing.fault_fs import tmpfs

import kvtier
from kvtier.errors import ConfigError
from kvtier.tiers.cpu import backend as backend_module
from kvtier.tiers.cpu.region import SharedRegion

SRC = os.path.join(os.path.dirname(kvtier.__file__), os.pardir)

# A region of 2 MiB on a 4 MiB tmpfs, then another file takes every free byte, then the
# engine writes every row (as stores into the CPU tier would, over time).
FILL_AFTER_START = """
import errno, os, sys
sys.path.insert(0, sys.argv[1])
from kvtier.tiers.cpu import region as region_module
if sys.argv[3] == "unreserved":
    region_module._reserve = lambda *args: None  # the behaviour before reservation
mnt = sys.argv[2]
region = region_module.SharedRegion.create(128, 16384, path=os.path.join(mnt, "region"))
with open(os.path.join(mnt, "filler"), "wb", buffering=0) as filler:
    try:
        while True:
            filler.write(b"x" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
assert os.statvfs(mnt).f_bavail == 0
for row in range(region.num_rows):
    region.rows[row] = row % 251
assert all(int(region.rows[row][-1]) == row % 251 for row in range(region.num_rows))
print("wrote every row", flush=True)
region.close()
"""


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "unreserved-control"])
def test_a_shm_filled_after_start_never_kills_the_engine(reserved, tmp_path):
    with tmpfs(tmp_path / "shm", "4m") as mnt:
        done = subprocess.run(
            [sys.executable, "-c", FILL_AFTER_START, SRC, str(mnt), "reserved" if reserved else "unreserved"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if reserved:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "wrote every row"
    else:
        # the control shows the hole is real here: without the reservation, the first write
        # to a page the full tmpfs cannot back kills the process
        assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)


def test_a_region_larger_than_the_free_room_is_an_error_at_start(tmp_path):
    with tmpfs(tmp_path / "shm", "1m") as mnt:
        path = mnt / "region"
        with pytest.raises(ConfigError) as caught:
            SharedRegion.create(128, 16384, path=str(path), field="tiers[0].capacity")
        message = str(caught.value)
        assert caught.value.field == "tiers[0].capacity"
        assert f"({128 * 16384 + 4096} bytes)" in message  # the size: 128 rows of 16 KiB + header
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        assert f"1 MiB ({free} bytes) free there now" in message  # the free room
        assert "remount,size=" in message and "capacity" in message  # the fixes
        assert not path.exists()  # nothing left behind
        assert os.statvfs(mnt).f_bfree == os.statvfs(mnt).f_blocks  # its pages went back


def test_build_manager_names_the_cpu_tier_when_shm_is_short(tmp_path, monkeypatch):
    """The early statvfs check can be beaten by another process filling /dev/shm between it
    and the creation (simulated here by hiding the free room from it): the reservation still
    turns the shortfall into a ConfigError naming the field."""
    monkeypatch.setattr(backend_module, "_free_space_bytes", lambda directory: None)
    with tmpfs(tmp_path / "shm", "1m") as mnt:
        config = {
            "tiers": [
                {
                    "name": "cpu",
                    "kind": "cpu",
                    "capacity": "4MiB",
                    "pin_memory": "off",
                    "path": str(mnt / "region"),
                }
            ]
        }
        with pytest.raises(
            ConfigError, match=r"tiers\[0\]\.capacity.*free there.*Fix: lower the CPU tier's capacity"
        ):
            kvtier.build_manager(config, 16384)
        assert not (mnt / "region").exists()

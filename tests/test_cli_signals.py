"""SIGTERM and SIGHUP (how systemd, Docker and Kubernetes stop a service) end a kvtier command
normally: the CPU tier's region leaves /dev/shm and replay's temporary store its folder."""

import glob
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tiers.cpu.region import NAME_PREFIX, default_directory

SRC = str(Path(__file__).resolve().parents[1] / "src")


def regions_of(pid):
    """The region files in the shared-memory folder whose header names ``pid`` as creator."""
    found = []
    for path in glob.glob(os.path.join(default_directory(), NAME_PREFIX + "*")):
        try:
            with open(path, "rb") as region:
                raw = region.read(48)
        except OSError:
            continue
        if len(raw) == 48 and raw[:8] == b"KVTIERSH" and struct.unpack_from("<Q", raw, 40)[0] == pid:
            found.append(path)
    return found


def _wait_for(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.slow
def test_a_replay_stopped_mid_run_removes_its_region_and_store(tmp_path, signum):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "replay", "--no-progress", "--no-baseline", "--json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # mid-run: the region and the temporary store exist, requests are being served
        started = _wait_for(lambda: regions_of(process.pid) and list(tmp_path.glob("kvtier-replay-*")))
        assert started, "the replay never created its region and store"
        regions = regions_of(process.pid)
        time.sleep(0.5)
        assert process.poll() is None, "the replay ended before it could be stopped"
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum, err.decode()
    assert b"Traceback" not in err, err.decode()
    assert f"stopped by {signal.Signals(signum).name}".encode() in err
    assert out == b""  # no half report
    assert regions and not any(os.path.lexists(path) for path in regions)
    assert list(tmp_path.iterdir()) == []  # the temporary store is gone

"""SIGTERM and SIGHUP (how systemd, Docker and Kubernetes stop a service) end a kvtier command
normally: the CPU tier's region leaves /dev/shm and replay's temporary store its folder."""

import contextlib
import glob
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvtier
from kvtier.tiers.cpu.region import NAME_PREFIX, default_directory

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: the kvtier under test (the subprocesses run the same code as this one)
KVTIER_SRC = str(Path(kvtier.__file__).resolve().parents[1])


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


def _start_replay(tmp_path, output):
    """``kvtier replay`` of the bundled trace in a process of its own, from ``tmp_path``, its
    temporary store under ``tmp_path/cache``; its stdout and stderr to ``output``."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # where the temporary store goes
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "replay", "--no-progress", "--no-baseline", "--json"],
        cwd=tmp_path,
        env=env,
        stdout=output,
        stderr=output,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.slow
def test_a_replay_stopped_mid_run_removes_its_region_and_store(tmp_path, signum):
    scratch = tmp_path / "cache" / "kvtier"
    process = _start_replay(tmp_path, subprocess.PIPE)
    try:
        # mid-run: the region and the temporary store exist, requests are being served
        started = _wait_for(lambda: regions_of(process.pid) and list(scratch.glob("replay-*")))
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
    assert list(scratch.iterdir()) == []  # the temporary store is gone


def _session_processes(sid):
    """Pids of the live processes in session ``sid`` (a command and all it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":  # field 6 of the line: the session
            found.append(int(entry))
    return found


def _engine_processes(parent):
    """Pids of the fleet's engine processes (multiprocessing's spawned children of ``parent``)."""
    found = []
    for pid in _session_processes(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _kvtier(args, cwd):
    env = {**os.environ, "PYTHONPATH": KVTIER_SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own session: whatever it leaves behind can be found and ended
    )


@pytest.mark.slow
@pytest.mark.parametrize(("engines", "moment"), [(12, "starting"), (3, "running")])
def test_a_fleet_stopped_ends_its_engines_and_exits_within_seconds(tmp_path, engines, moment):
    """Issue #32, item 6: SIGTERM to ``kvtier replay --engines N``, while its engines start or
    once they run, ends them (each closing its stack and region), the local server and the
    temporary stores, and the command exits; it neither waits for each engine to finish the
    trace nor, stopped mid-start, for engines that wait on ones never started."""
    process = _kvtier(["replay", "--engines", str(engines), "--no-progress", "--json"], tmp_path)
    try:
        seen = []

        def ready():
            seen[:] = _engine_processes(process.pid)
            if moment == "starting":
                return bool(seen)
            return len(seen) == engines and all(regions_of(pid) for pid in seen)

        assert _wait_for(ready, timeout_s=120), f"the fleet's engines never got to {moment}"
        process.send_signal(signal.SIGTERM)
        regions = [path for pid in seen for path in regions_of(pid)]
        try:
            out, err = process.communicate(timeout=60)  # a hang guard, not a speed test
        except subprocess.TimeoutExpired:
            pytest.fail("kvtier replay --engines still ran 60 s after SIGTERM")
        assert process.returncode == 128 + signal.SIGTERM, err.decode()
        assert b"Traceback" not in err and b"stopped by SIGTERM" in err, err.decode()
        assert out == b""
        assert _wait_for(lambda: _session_processes(process.pid) == [], timeout_s=30), "processes left"
        assert not any(os.path.lexists(path) for path in regions)
        assert list(tmp_path.iterdir()) == []  # the engines' stores are gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_fleet_of_too_many_engines_is_refused_before_anything_starts(tmp_path):
    process = _kvtier(["replay", "--engines", "100000", "--no-progress"], tmp_path)
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("kvtier replay --engines 100000 was not refused")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 2, err.decode()
    assert b"--engines takes 1 to 64" in err and b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_plan_stopped_mid_run_ends_its_workers_and_exits_within_seconds(tmp_path):
    """Issue #32, item 6: SIGTERM to ``kvtier plan --jobs 2`` ends its simulation processes
    at once, instead of running every simulation still queued before it exits."""
    process = _kvtier(["plan", "--jobs", "2", "--json"], tmp_path)
    try:
        assert _wait_for(lambda: len(_engine_processes(process.pid)) == 2, timeout_s=120), "no workers"
        time.sleep(1)  # simulating by now
        process.send_signal(signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=60)  # a hang guard, not a speed test
        except subprocess.TimeoutExpired:
            pytest.fail("kvtier plan still ran 60 s after SIGTERM")
        assert process.returncode == 128 + signal.SIGTERM, err.decode()
        assert b"Traceback" not in err and out == b"", err.decode()
        assert _wait_for(lambda: _session_processes(process.pid) == [], timeout_s=30), "processes left"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


HANGING_CLEANUP = """
import sys, time
from kvtier.cli import signals
signals.CLEANUP_DEADLINE_S = 1.0
with signals.stop_on_signals():
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        time.sleep(60)  # a clean-up that never ends
"""


def test_a_clean_up_that_hangs_after_a_stop_signal_still_ends_the_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-c", HANGING_CLEANUP], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout.readline() == b"ready\n"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - started < 20
    assert b"the clean-up after SIGTERM did not end within 1 s; exiting without it" in err


@pytest.mark.slow
def test_a_killed_replays_store_is_removed_by_the_next_command_never_a_live_ones(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer's) gives a command no clean-up: its temporary store stays.
    The next scratch folder made under the same cache root removes it, and leaves alone one
    whose command still runs."""
    from kvtier.tiers.disk.store import SCRATCH_OWNER, scratch_directory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the replay's root, and ours
    scratch = tmp_path / "cache" / "kvtier"
    process = _start_replay(tmp_path, subprocess.DEVNULL)
    regions = []
    try:
        owned = lambda: [p for p in scratch.glob("replay-*") if (p / SCRATCH_OWNER).exists()]  # noqa: E731
        assert _wait_for(lambda: regions_of(process.pid) and owned()), "the replay never made its store"
        regions = regions_of(process.pid)
        [theirs] = owned()
        with scratch_directory("test-") as mine:  # the replay lives: its store stays
            assert theirs.is_dir() and os.path.isdir(mine)
        assert process.poll() is None, "the replay ended before it could be killed"
        process.kill()
        process.wait()
        assert theirs.is_dir()  # nothing of it ran: the store is left behind
        with scratch_directory("test-") as mine:
            assert not theirs.exists() and os.path.isdir(mine)
        assert list(scratch.iterdir()) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for path in regions:  # a killed replay cannot remove its region either
            with contextlib.suppress(OSError):
                os.unlink(path)

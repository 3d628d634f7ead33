"""Processes: a writer killed with SIGKILL mid-stream, and two processes sharing one store."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtier_testing import key
from kvtier_testing.store import KINDS, holds, load, open_tier, region

TESTS = Path(__file__).resolve().parents[2]

WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])  # tests/, for kvtier_testing
from kvtier_testing import key
from kvtier_testing.store import fill, open_tier, region
from kvtier.tiers.base import TierJob

kind, path, fsync, shm_path = sys.argv[2:6]
shm = region(4, path=shm_path)
tier = open_tier(kind, path, shm.rows, 4000, fsync=fsync)
i = job = 0
while True:
    keys = (key(i), key(i + 1))
    for row, k in enumerate(keys):
        fill(shm.rows, row, k)
    tier.submit_store(TierJob(job, keys, (0, 1)))
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert result.success, result.failed
    print(" ".join(k.hex() for k in result.ok), flush=True)  # only after the commit returned
    i, job = i + 2, job + 1
"""

SHARER = r"""
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])  # tests/, for kvtier_testing
from kvtier_testing import key
from kvtier_testing.store import holds, load, open_tier, region, store

kind, path, seed, shm_path, go = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
shm = region(16, path=shm_path)
tier = open_tier(kind, path, shm.rows, 24)
print("ready", flush=True)
while not os.path.exists(go):  # both processes start together, so their jobs interleave
    time.sleep(0.001)
rng = random.Random(seed)
universe = [key(i) for i in range(40)]
wrong = stored = loaded = 0
reasons = {}
for _ in range(150):
    result = store(tier, shm.rows, rng.sample(universe, 4))
    stored += len(result.ok)
    for reason in map(str, result.failed.values()):
        reasons[reason] = reasons.get(reason, 0) + 1
    present = [k for k in rng.sample(universe, 8) if tier.lookup(k)]
    result = load(tier, shm.rows, present, first_row=8)
    for i, k in enumerate(present):
        if k in result.ok:
            loaded += 1
            wrong += not holds(shm.rows, 8 + i, k)
        else:
            reason = str(result.failed[k])
            reasons[reason] = reasons.get(reason, 0) + 1
tier.close()
print(json.dumps({"wrong": wrong, "stored": stored, "loaded": loaded, "reasons": reasons}))
"""


def child(code, *args):
    return subprocess.Popen(
        [sys.executable, "-c", code, str(TESTS), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def shm():
    r = region(64)
    yield r
    r.close()


@pytest.mark.parametrize("fsync", ["batch", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_writer_killed_mid_stream_leaves_a_healthy_store(kind, fsync, tmp_path, shm):
    store_path = tmp_path / "store"
    writer = child(WRITER, kind, store_path, fsync, tmp_path / "writer-shm")
    committed = []
    try:
        deadline = time.monotonic() + 60
        while len(committed) < 40 and time.monotonic() < deadline:
            line = writer.stdout.readline()
            if not line:
                break
            committed.extend(bytes.fromhex(h) for h in line.split())
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL, writer.stderr.read()
    assert len(committed) >= 40

    tier = open_tier(kind, store_path, shm.rows, 4000)
    report = tier.check()
    assert report.healthy, report.problems
    for first in range(0, len(committed), 16):
        batch = committed[first : first + 16]
        result = load(tier, shm.rows, batch, first_row=32)
        assert result.ok == batch, result.failed
        assert all(holds(shm.rows, 32 + i, k) for i, k in enumerate(batch))
    tier.close()
    leftovers = [p for p in store_path.rglob("*.tmp")]
    assert leftovers == []


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_share_one_store(kind, tmp_path, shm):
    store_path = tmp_path / "store"
    go = tmp_path / "go"
    sharers = [child(SHARER, kind, store_path, seed, tmp_path / f"shm-{seed}", go) for seed in (1, 2)]
    for process in sharers:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()
    go.touch()
    outcomes = []
    for process in sharers:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    for outcome in outcomes:
        assert outcome["wrong"] == 0  # never another key's bytes
        assert outcome["stored"] > 0 and outcome["loaded"] > 0
        assert set(outcome["reasons"]) <= {"full", "missing"}, outcome["reasons"]
    tier = open_tier(kind, store_path, shm.rows, 24)
    assert tier.check().healthy
    assert tier.num_blocks() <= 24
    present = [k for k in (key(i) for i in range(40)) if tier.lookup(k)]
    result = load(tier, shm.rows, present, first_row=10)
    assert result.ok == present
    assert all(holds(shm.rows, 10 + i, k) for i, k in enumerate(present))
    tier.close()

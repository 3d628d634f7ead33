"""A writer SIGKILLed again and again at random points, for each disk kind.

The writer (``python -m kvtier.soak.store_process writer``) stores jobs of 4 new keys with
``fsync: batch`` and LRU eviction into a store smaller than everything written, and prints a
job's keys only after its result said they are stored. The parent reads those lines for a
random while, sleeps a random 0-20 ms (so the kill lands anywhere: mid-write, mid-commit,
mid-eviction), and sends SIGKILL. After each kill:

* ``check_store`` (what ``kvtier check PATH`` runs) finds the store healthy, or ``--fix``
  heals it (the tally of fixes is in the failure message);
* no block reported stored is lost: the writer only stores, so LRU evicts in store order, and
  a committed block may be missing only if it is older than every block still there (and the
  store is then nearly full: eviction took only the room new blocks needed);
* nothing torn is visible: every key the store holds loads and is exactly that key's block.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import kvtier
from kvtier.soak.blocks import block_key, is_exact
from kvtier.soak.store_process import JOB_KEYS, open_tier
from kvtier.tiers.base import TierJob
from kvtier.tiers.cpu.region import SharedRegion
from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.format import on_disk_block_bytes

SRC = os.path.dirname(os.path.dirname(kvtier.__file__))
BLOCK = 10_000
CAPACITY = 96  # blocks; the runs write more than this in all, so eviction runs between kills
KILLS = 10


def start_writer(kind, path, first_key, shm_dir, codec="none"):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.soak.store_process",
            "writer",
            kind,
            str(path),
            str(CAPACITY),
            str(BLOCK),
            str(first_key),
            "kill-loop",
            "--shm-dir",
            str(shm_dir),
            "--codec",
            codec,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def run_until_killed(writer, rng) -> list[bytes]:
    """Committed keys the writer reported, until SIGKILL after a random number of jobs."""
    assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
    committed: list[bytes] = []
    jobs = rng.randint(1, 12)
    try:
        for _ in range(jobs):
            line = writer.stdout.readline()
            if not line:
                break
            committed.extend(bytes.fromhex(h) for h in line.split())
        time.sleep(rng.uniform(0, 0.02))
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    # lines written before the kill but not read yet were committed too
    committed.extend(bytes.fromhex(h) for line in writer.stdout.read().splitlines() for h in line.split())
    assert writer.returncode == -signal.SIGKILL, writer.stderr.read()
    return committed


def load_all(tier, rows, keys, kv=False) -> tuple[list[bytes], int]:
    """Load ``keys`` in jobs of 8; ``(keys served, wrong blocks among them)``."""
    served, wrong = [], 0
    for first in range(0, len(keys), 8):
        batch = tuple(keys[first : first + 8])
        job = TierJob(first + 1, batch, tuple(range(len(batch))))
        tier.submit_load(job)
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        for row, k in enumerate(batch):
            if k in result.ok:
                served.append(k)
                wrong += not is_exact(rows[row], k, kv)
    return served, wrong


def files_bytes(store) -> int:
    """What a ``files`` store's block directories hold: published blocks and temp files."""
    return sum(path.stat().st_size for path in (store / "blocks").rglob("*") if path.is_file())


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "codec"), [("lmdb", "none"), ("files", "none"), ("files", "lossless")])
def test_a_writer_killed_again_and_again(kind, codec, tmp_path):
    """With ``lossless`` (KV-like blocks) a ``files`` store counts pages: a kill leaves its
    count too high, never its files over the capacity, and it holds more blocks than raw."""
    store = tmp_path / "store"
    shm_dir = tmp_path / "shm"  # the killed writers' regions are left here, not in /dev/shm
    shm_dir.mkdir()
    kv = codec != "none"
    capacity_bytes = CAPACITY * on_disk_block_bytes(BLOCK)
    most = 0
    rng = random.Random(f"kill-loop-{kind}-{codec}")
    committed: list[bytes] = []
    fixes: list[str] = []
    region = SharedRegion.create(8, BLOCK)
    try:
        for kill in range(KILLS):
            committed += run_until_killed(start_writer(kind, store, kill * 1000, shm_dir, codec), rng)
            if kind == "files":  # the killed writer's temp file included
                assert files_bytes(store) <= capacity_bytes

            report = check_store(str(store))
            if not report.healthy:
                fixes.append(f"kill {kill}: {report.problems}")
                assert check_store(str(store), fix=True).fixed
                report = check_store(str(store))
            assert report.healthy, (report.problems, fixes)

            tier = open_tier(kind, str(store), CAPACITY, BLOCK, region.rows, codec=codec)
            try:
                # every key any writer may have written, reported or not (the job in flight)
                written = [
                    block_key(n, "kill-loop")
                    for run in range(kill + 1)
                    for n in range(run * 1000, run * 1000 + 1000)
                ]
                job_of = {k: i // JOB_KEYS for i, k in enumerate(written)}  # write order, by job
                present = [k for k in written if tier.lookup(k)]
                assert len(present) == tier.num_blocks()  # nothing unknown
                held = tier.stats()["held_bytes"]
                assert held <= capacity_bytes and (kv or len(present) <= CAPACITY)  # nothing over
                most = max(most, len(present))
                served, wrong = load_all(tier, region.rows, present, kv)
                assert wrong == 0 and served == present  # nothing torn is ever visible
                assert tier.stats()["corrupt"] == 0
                # The writer only stores, so LRU evicts in store order: a committed block may be
                # missing only if it is older than every block still there (same job: a tie).
                kept = set(present)
                missing = [k for k in committed if k not in kept]
                if missing:
                    assert max(map(job_of.get, missing)) <= min(map(job_of.get, present)), (
                        f"kill {kill}: committed blocks lost while older ones stayed"
                    )
                    # and eviction took only what room required: the store is nearly full
                    assert held >= capacity_bytes - 2 * JOB_KEYS * tier.slot_bytes, (held, len(missing))
            finally:
                tier.close()
        assert len(committed) > CAPACITY  # eviction was part of it
        if kv:  # 3 pages a block, where a raw one takes 4
            assert most > CAPACITY, most
    finally:
        region.close()

"""Two processes on one store under load: both storing, loading and evicting at once, into a
store far smaller than what they write (32 blocks, 200 keys, 8-key jobs back to back).

While they run, this process samples the store from outside (the files on disk, or LMDB's
index read by a third reader) and the capacity is never exceeded. Afterwards: no wrong byte
was ever served, each process's counters add up with what its jobs returned, the store
checks healthy, and every block it holds is exact.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest

import kvtier
from kvtier.soak.blocks import block_key, is_exact, payload
from kvtier.soak.store_process import open_tier
from kvtier.tiers.base import TierJob
from kvtier.tiers.cpu.region import SharedRegion
from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.format import PAGE_BYTES, on_disk_block_bytes

SRC = os.path.dirname(os.path.dirname(kvtier.__file__))
BLOCK = 10_000
CAPACITY = 32
UNIVERSE = 200
SECONDS = 2.0
MIN_JOBS = 20  # however loaded the machine, each does this much


def sharer(kind, path, seed, shm_dir, codec="none"):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.soak.store_process",
            "sharer",
            kind,
            str(path),
            str(CAPACITY),
            str(BLOCK),
            str(seed),
            str(SECONDS),
            str(UNIVERSE),
            "shared",
            str(MIN_JOBS),
            "--shm-dir",
            str(shm_dir),
            "--wait-go",
            "--codec",
            codec,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def blocks_on_disk(kind: str, path: Path, index) -> int:
    """Blocks (pages, for a ``files`` store of a lossless codec) the store holds right now,
    seen from outside the two processes.

    ``files``: the shared usage count, read under its flock as the tiers change it. A scan of
    the 256 directories is no snapshot (while it runs, files go in one directory and come in
    another, and it counted 36 of 32); the count is raised before a block is written and
    lowered after its file is gone, so it bounds the files on disk at every instant.
    ``lmdb``: the entries of the index, in one read transaction (a snapshot).
    """
    if kind == "files":
        with open(path / "usage", "rb") as usage:
            fcntl.flock(usage, fcntl.LOCK_SH)
            raw = usage.read(8)
            return struct.unpack("<Q", raw)[0] if raw else 0  # a new store's count is not written yet
    with index.begin() as txn:
        return txn.stat(index.open_db(b"blocks", txn=txn, create=False))["entries"]


def bytes_on_disk(store: Path) -> int:
    """What the block files of a ``files`` store take (headers included)."""
    return sum(path.stat().st_size for path in (store / "blocks").rglob("*.kvb"))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "codec"), [("lmdb", "none"), ("files", "none"), ("files", "lossless")])
def test_two_processes_store_load_and_evict_at_once(kind, codec, tmp_path):
    """With ``lossless`` the files store counts pages, and holds more blocks than raw ones
    fit in its bytes, never more bytes."""
    store = tmp_path / "store"
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    kv = codec != "none"
    capacity_bytes = CAPACITY * on_disk_block_bytes(BLOCK)
    limit = capacity_bytes // PAGE_BYTES if kv else CAPACITY  # in the usage count's units
    processes = [sharer(kind, store, seed, shm_dir, codec) for seed in (1, 2)]
    for process in processes:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()
    index = lmdb.open(str(store / "index"), readonly=True, max_dbs=4, lock=True) if kind == "lmdb" else None
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(blocks_on_disk(kind, store, index))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    tallies = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err
            tallies.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.set()
        sampler.join()
        if index is not None:
            index.close()

    assert samples and max(samples) <= limit, (len(samples), max(samples))
    for tally in tallies:
        stats = tally["stats"]
        assert tally["wrong"] == 0, tally  # never another key's bytes, never damaged ones
        assert tally["jobs"] >= MIN_JOBS and tally["store_ok"] > 0 and tally["load_ok"] > 0, tally
        assert set(tally["reasons"]) <= {"full", "missing"}, tally
        # the counters add up with what the jobs returned
        assert stats["loaded"] == tally["load_ok"]
        assert stats["failed_keys"] == tally["store_failed"] + tally["load_failed"]
        assert sum(stats.get(f"failed_{r}", 0) for r in tally["reasons"]) == stats["failed_keys"]
        assert stats["missing"] == tally["reasons"].get("missing", 0)
        assert stats["stored"] <= tally["store_ok"] and stats["corrupt"] == 0
        assert stats["held_bytes"] <= capacity_bytes
        assert stats["blocks"] <= (2 * CAPACITY if kv else CAPACITY)
    assert sum(t["stats"]["evicted"] for t in tallies) > 0  # eviction ran under load

    report = check_store(str(store))
    assert report.healthy, report.problems
    if kind == "files":
        assert bytes_on_disk(store) <= capacity_bytes
    region = SharedRegion.create(8, BLOCK)
    tier = open_tier(kind, str(store), CAPACITY, BLOCK, region.rows, codec=codec)
    try:
        present = [k for k in (block_key(n, "shared") for n in range(UNIVERSE)) if tier.lookup(k)]
        assert 0 < len(present) == tier.num_blocks()
        assert len(present) <= (capacity_bytes // (3 * PAGE_BYTES) if kv else CAPACITY)
        for first in range(0, len(present), 8):
            batch = tuple(present[first : first + 8])
            tier.submit_load(TierJob(first + 1, batch, tuple(range(len(batch)))))
            tier.drain_jobs()
            (result,) = tier.get_finished_jobs()
            assert result.ok == list(batch)
            assert all(is_exact(region.rows[row], k, kv) for row, k in enumerate(batch))
        if kv:
            # How full the two left it depends on how their evictions interleaved (each
            # evicts by its own view of the count, for the largest block's room: on a loaded
            # machine both once left 29 blocks). Filled by this process alone, at 3 pages a
            # block where a raw one takes 4, the same bytes hold a third more.
            fresh = [block_key(n, "top-up") for n in range(2 * CAPACITY)]
            for first in range(0, len(fresh), 8):
                batch = tuple(fresh[first : first + 8])
                for row, k in enumerate(batch):
                    region.rows[row] = payload(k, BLOCK, kv)
                tier.submit_store(TierJob(1000 + first, batch, tuple(range(len(batch)))))
                tier.drain_jobs()
                (result,) = tier.get_finished_jobs()
                assert result.ok == list(batch)
            assert CAPACITY < tier.num_blocks() <= capacity_bytes // (3 * PAGE_BYTES), tier.num_blocks()
    finally:
        tier.close()
        region.close()


@pytest.mark.parametrize(("kind", "codec"), [("lmdb", "none"), ("files", "none"), ("files", "lossless")])
def test_a_store_filled_by_another_process_takes_new_blocks_again(kind, codec, tmp_path):
    """A process that holds too few blocks to make room by evicting its own learns the other
    processes' blocks when the medium refuses room, and evicts those: before, it answered
    ``full`` to every store for the rest of its life, even once the other process had exited."""
    store = tmp_path / "store"
    kv = codec != "none"
    region = SharedRegion.create(8, BLOCK)
    tier = open_tier(kind, str(store), CAPACITY, BLOCK, region.rows, codec=codec)
    try:
        writer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.soak.store_process",
                "writer",
                kind,
                str(store),
                str(CAPACITY),
                str(BLOCK),
                "0",
                "filler",
                "--shm-dir",
                str(tmp_path),
                "--codec",
                codec,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": SRC},
        )
        committed = []
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        while len(committed) < 2 * CAPACITY:  # the store is full of the writer's blocks
            committed.extend(bytes.fromhex(h) for h in writer.stdout.readline().split())
        writer.kill()
        writer.wait()
        # The writer runs ahead of this reader (its lines wait in the pipe), so the store
        # holds its latest blocks, which may all be past the lines read so far: read the rest.
        # Each line is one write(2) under PIPE_BUF, so a kill never leaves half a line.
        committed.extend(bytes.fromhex(h) for h in writer.stdout.read().split())

        def store_batch(attempt: int) -> int:
            keys = tuple(block_key(100 * attempt + n, "mine") for n in range(8))
            for row, k in enumerate(keys):
                region.rows[row] = payload(k, BLOCK, kv)
            tier.submit_store(TierJob(attempt + 1, keys, tuple(range(8))))
            tier.drain_jobs()
            (result,) = tier.get_finished_jobs()
            return len(result.ok)

        outcomes = []
        while len(outcomes) < 4 and (not outcomes or outcomes[-1] < 8):
            # until room is back: more of ours would evict the adopted blocks read below (the
            # store holds 32: four full batches of 8 can leave none of theirs)
            outcomes.append(store_batch(len(outcomes)))
        # refused (all, or all but the slots the killed writer had reserved for writes in
        # flight, which a later store reclaims from the dead process), then room again
        assert outcomes[0] < 8 and outcomes[-1] == 8, outcomes
        assert tier.stats()["adopted"] > 0
        assert tier.stats()["held_bytes"] <= CAPACITY * on_disk_block_bytes(BLOCK)
        # the adopted blocks are served too, exactly
        theirs = [k for k in committed if tier.lookup(k)]
        assert theirs
        batch = tuple(theirs[:8])
        tier.submit_load(TierJob(99, batch, tuple(range(len(batch)))))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.ok == list(batch)
        assert all(is_exact(region.rows[row], k, kv) for row, k in enumerate(batch))
        for attempt in range(len(outcomes), 4):  # later stores reclaim the dead writer's slots
            assert store_batch(attempt) == 8
    finally:
        tier.close()
        region.close()
    assert check_store(str(store)).healthy
    if kind == "files":
        assert bytes_on_disk(store) <= CAPACITY * on_disk_block_bytes(BLOCK)

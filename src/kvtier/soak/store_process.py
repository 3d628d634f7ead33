"""Processes that work on one disk-tier store, for kill loops and sharing under load.

Run as ``python -m kvtier.soak.store_process ROLE KIND PATH CAPACITY_BLOCKS BLOCK_BYTES ...``:

* ``writer START SALT``: stores jobs of :data:`JOB_KEYS` new keys (``START``, ``START+1`` ...)
  with ``fsync: batch`` and LRU eviction, forever, and prints the keys of each job on one line
  (hex) only after the job's result said they are stored — the lines are the committed record
  a parent holds against the store after it kills the writer (SIGKILL at any moment).
* ``sharer SEED SECONDS UNIVERSE [SALT [MIN_JOBS]]``: for ``SECONDS`` (and at least ``MIN_JOBS``
  store jobs), stores random keys out of ``UNIVERSE``,
  loads random keys it finds present, and verifies every loaded block byte for byte; then
  prints one JSON line: its tallies (``store_ok``, ``store_failed``, ``load_ok``,
  ``load_failed``, ``wrong``, failure reasons) and its tier's ``stats()``.

The CPU rows are a private shared region per process (in ``--shm-dir``, default /dev/shm).
``--codec NAME`` stores blocks with that codec, and makes them KV-like bf16 values (which
``lossless`` compresses) rather than random bytes.
Each prints ``ready`` once the store is open; with ``--wait-go`` it then waits for a line on
stdin, so that two processes start their load together.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.soak.blocks import block_key, is_exact, payload
from kvtier.tiers.base import TierJob
from kvtier.tiers.cpu.region import SharedRegion
from kvtier.tiers.disk import open_store
from kvtier.tiers.disk.format import LayoutFingerprint, on_disk_block_bytes

__all__ = ["JOB_KEYS", "open_tier", "main"]

#: keys per writer job
JOB_KEYS = 4


def open_tier(
    kind: str, path: str, capacity_blocks: int, block_bytes: int, rows, threads: int = 4, codec: str = "none"
):
    """The store at ``path`` as the soak's processes open it (LRU, ``fsync: batch``): room
    for ``capacity_blocks`` raw blocks, stored with ``codec`` (bf16 values)."""
    config = DiskTierConfig(
        name="soak",
        kind=kind,
        path=path,
        eviction="lru",
        fsync="batch",
        capacity_bytes=capacity_blocks * on_disk_block_bytes(block_bytes),
        codec=codec,
    )
    fingerprint = LayoutFingerprint.standalone(block_bytes, "bfloat16" if codec != "none" else "uint8")
    return open_store(config, rows, fingerprint, threads=threads)


def _run(tier, job: TierJob, load: bool):
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
    return result


def _writer(tier, rows, start: int, salt: str, kv: bool) -> None:
    i = start
    job_id = 0
    while True:
        keys = tuple(block_key(n, salt) for n in range(i, i + JOB_KEYS))
        for row, key in enumerate(keys):
            rows[row] = payload(key, rows.shape[1], kv)
        job_id += 1
        result = _run(tier, TierJob(job_id, keys, tuple(range(JOB_KEYS))), load=False)
        if result.ok:
            print(" ".join(key.hex() for key in result.ok), flush=True)  # only once committed
        tier.take_events()
        i += JOB_KEYS


def _sharer(
    tier, rows, seed: int, seconds: float, universe: int, salt: str, min_jobs: int = 0, kv: bool = False
) -> dict:
    rng = random.Random(seed)
    keys = [block_key(n, salt) for n in range(universe)]
    half = rows.shape[0] // 2
    tally: dict[str, Any] = {
        "store_ok": 0,
        "store_failed": 0,
        "load_ok": 0,
        "load_failed": 0,
        "wrong": 0,
        "reasons": {},
        "jobs": 0,
    }
    job_id = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or tally["jobs"] < min_jobs:
        chosen = rng.sample(keys, half)
        for row, key in enumerate(chosen):
            rows[row] = payload(key, rows.shape[1], kv)
        job_id += 1
        result = _run(tier, TierJob(job_id, tuple(chosen), tuple(range(half))), load=False)
        tally["store_ok"] += len(result.ok)
        tally["store_failed"] += len(result.failed)
        for reason in result.failed.values():
            tally["reasons"][reason.counter] = tally["reasons"].get(reason.counter, 0) + 1
        present = [key for key in rng.sample(keys, half) if tier.lookup(key)]
        if present:
            for row in range(half, half + len(present)):
                rows[row] = 0
            job_id += 1
            job = TierJob(job_id, tuple(present), tuple(range(half, half + len(present))))
            result = _run(tier, job, load=True)
            for row, key in zip(job.rows, job.keys):
                if key in result.ok:
                    tally["load_ok"] += 1
                    tally["wrong"] += not is_exact(rows[row], key, kv)
                else:
                    tally["load_failed"] += 1
                    reason = result.failed[key]
                    tally["reasons"][reason.counter] = tally["reasons"].get(reason.counter, 0) + 1
        tier.take_events()
        tally["jobs"] += 1
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.soak.store_process")
    parser.add_argument("role", choices=("writer", "sharer"))
    parser.add_argument("kind", choices=("lmdb", "files"))
    parser.add_argument("path")
    parser.add_argument("capacity_blocks", type=int)
    parser.add_argument("block_bytes", type=int)
    parser.add_argument("args", nargs="*")
    parser.add_argument("--shm-dir", default=None)
    parser.add_argument("--codec", default="none", help="store blocks with this codec (KV-like bf16 blocks)")
    parser.add_argument(
        "--wait-go", action="store_true", help="after 'ready', wait for a line on stdin (to start together)"
    )
    options = parser.parse_args(argv)
    rows_needed = 2 * max(JOB_KEYS, 8)
    region_path = None
    if options.shm_dir:
        region_path = os.path.join(options.shm_dir, f"kvtier-soak-{os.getpid()}")
    region = SharedRegion.create(rows_needed, options.block_bytes, path=region_path)
    rows = region.rows
    tier = open_tier(
        options.kind, options.path, options.capacity_blocks, options.block_bytes, rows, codec=options.codec
    )
    kv = options.codec != "none"
    print("ready", flush=True)
    if options.wait_go:
        sys.stdin.readline()
    try:
        if options.role == "writer":
            start, salt = int(options.args[0]), options.args[1]
            _writer(tier, rows, start, salt, kv)
        else:
            seed, seconds, universe = int(options.args[0]), float(options.args[1]), int(options.args[2])
            salt = options.args[3] if len(options.args) > 3 else "shared"
            min_jobs = int(options.args[4]) if len(options.args) > 4 else 0
            tally = _sharer(tier, rows, seed, seconds, universe, salt, min_jobs, kv)
            tier.drain_jobs()
            tally["stats"] = tier.stats()
            print(json.dumps(tally, sort_keys=True), flush=True)
    finally:
        tier.close()
        region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Helpers for the disk-tier tests: CPU rows, configs, synchronous job runners, damage."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
from kvtier_testing import payload

from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk import open_store
from kvtier.tiers.base import TierJob, TierJobResult
from kvtier.tiers.disk.format import LayoutFingerprint, on_disk_block_bytes
from kvtier.tiers.disk.lmdb import _ENTRY
from kvtier.tiers.cpu.region import SharedRegion

#: not a multiple of 4096, so O_DIRECT moves each row's padded span (the case that needs care)
BLOCK = 10_000
KINDS = ("lmdb", "files")
#: ids of the jobs run() submits: far above the small fixed ids tests give the jobs they submit
#: themselves (TierJob(50, ...)), which the count, shared by every test in the process, would
#: otherwise reach in some orders (xdist's) and answer in place of the test's own job
_job_ids = itertools.count(1_000_000)


def fingerprint(block_bytes: int = BLOCK, model: str = "test-model") -> LayoutFingerprint:
    return LayoutFingerprint(
        model=model,
        dtype="bfloat16",
        tokens_per_block=16,
        page_bytes=(block_bytes,),
        rank=0,
        world_size=1,
        block_bytes=block_bytes,
    )


def config(kind: str, path, blocks: int, block_bytes: int = BLOCK, **options) -> DiskTierConfig:
    """A tier config holding exactly ``blocks`` blocks."""
    return DiskTierConfig(
        name="disk",
        kind=kind,
        capacity_bytes=blocks * on_disk_block_bytes(block_bytes),
        path=str(path),
        **options,
    )


def region(num_rows: int = 64, block_bytes: int = BLOCK, path: str | None = None) -> SharedRegion:
    """A real CPU-tier region (page-aligned, padded rows), in /dev/shm unless ``path`` says."""
    return SharedRegion.create(num_rows, block_bytes, path=path)


def open_tier(kind: str, path, rows: np.ndarray, blocks: int, fp: LayoutFingerprint | None = None, **options):
    threads = options.pop("threads", 2)
    cfg = config(kind, path, blocks, rows.shape[1], **options)
    return open_store(cfg, rows, fp or fingerprint(rows.shape[1]), threads=threads)


def fill(rows: np.ndarray, row: int, key: bytes) -> None:
    rows[row] = payload(key, rows.shape[1])


def holds(rows: np.ndarray, row: int, key: bytes) -> bool:
    """Whether CPU row ``row`` holds exactly ``key``'s bytes."""
    return bool(np.array_equal(rows[row], payload(key, rows.shape[1])))


def run(tier, keys, rows_idx, load: bool, others: list | None = None) -> TierJobResult:
    """Submit one job, wait for it, return its result.

    Results of other jobs that finish meanwhile go to ``others``; without it, none may.
    """
    job = TierJob(next(_job_ids), tuple(keys), tuple(rows_idx))
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    results = tier.get_finished_jobs()
    mine = [r for r in results if r.job_id == job.job_id]
    rest = [r for r in results if r.job_id != job.job_id]
    assert len(mine) == 1 and (others is not None or not rest), results
    if others is not None:
        others.extend(rest)
    return mine[0]


def store(tier, rows: np.ndarray, keys, first_row: int = 0, others: list | None = None) -> TierJobResult:
    """Fill rows with the keys' payloads and store them."""
    indexes = list(range(first_row, first_row + len(keys)))
    for row, key in zip(indexes, keys):
        fill(rows, row, key)
    return run(tier, keys, indexes, load=False, others=others)


def load(tier, rows: np.ndarray, keys, first_row: int = 0, others: list | None = None) -> TierJobResult:
    """Zero the destination rows, then load the keys into them."""
    indexes = list(range(first_row, first_row + len(keys)))
    for row in indexes:
        rows[row] = 0
    return run(tier, keys, indexes, load=True, others=others)


def dead_pid() -> int:
    """The pid of a process that has exited (for stale-lock and crashed-writer cases)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def locate(tier, k):
    """(file, offset) of key ``k``'s block on disk."""
    if tier.kind == "lmdb":
        with tier._env.begin() as txn:
            slot = _ENTRY.unpack(txn.get(k, db=tier._blocks))[0]
        return os.path.join(tier.path, "slab.kvs"), slot * tier.slot_bytes
    return tier._shown(tier._path_of(k, tier._policy.get(k))), 0


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))

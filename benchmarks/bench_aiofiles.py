"""What ``aiofiles`` would cost kvtier per block read, against the call kvtier makes today.

    python benchmarks/bench_aiofiles.py [--calls 400] [--rounds 5] [--dir /var/tmp]

Why this exists: ``aiofiles`` was a declared dependency that nothing imported, and the issue
asked whether to give it a caller (an asyncio surface that loads blocks by key) or drop it.
This measures the one thing such a caller would add: reading one 2 MiB block of a file whose
pages are cached (so the disk is out of the picture and only the call path differs), from
an asyncio program, per call:

* ``preadv_thread``: ``await loop.run_in_executor(pool, os.preadv, fd, [row], offset)`` —
  kvtier's own path (a blocking ``preadv`` straight into a preallocated row, on a thread);
* ``aiofiles_read``: ``await f.seek(offset); await f.read(n)`` on a file opened once with
  ``aiofiles.open`` — two thread-pool round trips, and a new ``bytes`` object per read;
* ``aiofiles_readinto``: the same, reading into the row with ``await f.readinto(row)``;
* ``preadv_direct_call``: ``os.preadv`` called without asyncio (the floor).

Each path is timed for 4 KiB reads (where the per-call dispatch is nearly all the cost) and
2 MiB reads (a block); each figure is the median over ``--rounds`` of the mean microseconds
per call, the paths alternating within a round. The JSON line has them and
``aiofiles_overhead_<size>_us`` = aiofiles_read - preadv_thread: what an aiofiles caller adds
per call (two executor round trips instead of one: constant per call; plus, for ``read``, a
copy into a new ``bytes`` that grows with the block at memory speed). Needs ``pip install
aiofiles`` (no longer a kvtier dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from statistics import median

import numpy as np

from kvtier.bench.report import print_json, print_table

BLOCK_BYTES = 2 << 20
BLOCKS = 8
#: read sizes measured: a 4 KiB read isolates the per-call dispatch, a 2 MiB one is a block
SIZES = (4096, BLOCK_BYTES)


async def _preadv_thread(fd: int, rows: np.ndarray, calls: int, pool: ThreadPoolExecutor, size: int) -> float:
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    for i in range(calls):
        block = i % BLOCKS
        await loop.run_in_executor(pool, os.preadv, fd, [rows[block, :size]], block * BLOCK_BYTES)
    return (time.perf_counter() - start) / calls


async def _aiofiles(
    path: str, rows: np.ndarray, calls: int, pool: ThreadPoolExecutor, into: bool, size: int
) -> float:
    import aiofiles

    loop = asyncio.get_running_loop()
    async with aiofiles.open(path, "rb", buffering=0, executor=pool, loop=loop) as stream:
        start = time.perf_counter()
        for i in range(calls):
            block = i % BLOCKS
            await stream.seek(block * BLOCK_BYTES)
            if into:
                await stream.readinto(rows[block, :size])
            else:
                data = await stream.read(size)
                assert len(data) == size
        return (time.perf_counter() - start) / calls


def _direct(fd: int, rows: np.ndarray, calls: int, size: int = BLOCK_BYTES) -> float:
    start = time.perf_counter()
    for i in range(calls):
        block = i % BLOCKS
        os.preadv(fd, [rows[block, :size]], block * BLOCK_BYTES)
    return (time.perf_counter() - start) / calls


def run(calls: int = 400, rounds: int = 5, directory: str | None = None, out=sys.stdout) -> dict:
    try:
        import aiofiles  # noqa: F401
    except ImportError:
        raise SystemExit("bench_aiofiles needs aiofiles: pip install aiofiles") from None
    rows = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    paths = ("preadv_thread", "aiofiles_read", "aiofiles_readinto", "preadv_direct_call")
    samples: dict[tuple[str, int], list[float]] = {(p, size): [] for p in paths for size in SIZES}
    with tempfile.NamedTemporaryFile(dir=directory or "/var/tmp", prefix="kvtier-aiofiles-") as handle:
        handle.write(os.urandom(BLOCKS * BLOCK_BYTES))
        handle.flush()
        fd = os.open(handle.name, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(1) as pool:
                _direct(fd, rows, BLOCKS)  # the page cache holds the file from here on
                # the paths alternate within each round, so load on the machine hits all alike
                for _ in range(rounds):
                    for size in SIZES:
                        samples["preadv_thread", size].append(
                            asyncio.run(_preadv_thread(fd, rows, calls, pool, size))
                        )
                        samples["aiofiles_read", size].append(
                            asyncio.run(_aiofiles(handle.name, rows, calls, pool, False, size))
                        )
                        samples["aiofiles_readinto", size].append(
                            asyncio.run(_aiofiles(handle.name, rows, calls, pool, True, size))
                        )
                        samples["preadv_direct_call", size].append(_direct(fd, rows, calls, size))
        finally:
            os.close(fd)
    us = {key: median(values) * 1e6 for key, values in samples.items()}
    table = [
        {
            "path": name,
            "bytes": size,
            "us_per_call": us[name, size],
            "minus_preadv_thread_us": us[name, size] - us["preadv_thread", size],
        }
        for size in SIZES
        for name in paths
    ]
    print(f"reads from the page cache, {calls} calls x {rounds} rounds (medians)", file=out)
    print_table(table, ["path", "bytes", "us_per_call", "minus_preadv_thread_us"], out)
    record: dict = {"bench": "aiofiles", "calls": calls, "rounds": rounds}
    for size in SIZES:
        label = "4k" if size == 4096 else "2m"
        for name in paths:
            record[f"{name}_{label}_us"] = us[name, size]
        record[f"aiofiles_overhead_{label}_us"] = us["aiofiles_read", size] - us["preadv_thread", size]
    print_json(record, out)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    run(args.calls, args.rounds, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

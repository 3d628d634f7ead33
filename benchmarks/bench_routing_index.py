"""What the prefix router's index costs per event and per request, as the fleet and the index grow.

    python benchmarks/bench_routing_index.py [--engines 2,8,32] [--blocks 10000,100000,1000000] [--rounds 5]

A fleet whose engines hold ``--blocks`` distinct block hashes in all, as conversations of 32
blocks behind a 4-block system prompt every engine holds: each conversation on its GPU in one
engine, its first half also in that engine's CPU tier, and in another engine's CPU tier
(where an earlier turn ran). Per size, medians over ``--rounds``:

* ``update_ns_per_block``: applying an engine's events (16 blocks stored on the GPU, 16 older
  ones removed) to a full index; baseline ``dict_update_ns_per_block``: the same blocks set in
  and deleted from a plain ``dict`` of hash -> engine, the least any index keyed by hash pays;
* ``score_us``: :meth:`PrefixIndex.score` of a request that follows one conversation (the
  system prompt, then its 32 blocks); baselines measured the same way: ``dict_walk_us``, one
  ``dict.get`` per block of the request (a walk with no per-engine work), and
  ``round_robin_us``, what routing a request costs a router that keeps no index;
* ``route_us``: :meth:`PrefixRouter.route` of the same request (score, load bound, choice);
* ``bytes_per_block``: the index's memory per hash it holds (tracemalloc, while filling).

The JSON line has one record per size (``results``) and the largest ratios to the dict walk.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from statistics import median

from kvtier.bench.report import print_json, print_table
from kvtier.routing import BlockEvent, PrefixIndex, PrefixRouter, RoundRobinRouter

SYSTEM_BLOCKS = 4
CHAIN_BLOCKS = 32
EVENT_BLOCKS = 16
#: requests scored (and events applied) per timing
SAMPLES = 2000


def _chain(conversation: int) -> list[int]:
    """The hashes of one conversation's blocks (the system prompt's are 0..3 for all)."""
    first = SYSTEM_BLOCKS + conversation * CHAIN_BLOCKS
    return list(range(first, first + CHAIN_BLOCKS))


def _fill(index: PrefixIndex, conversations: int) -> None:
    engines = index.engines
    for engine in range(engines):
        index.apply(engine, [BlockEvent("stored", "GPU", list(range(SYSTEM_BLOCKS)))])
    for conversation in range(conversations):
        chain = _chain(conversation)
        home, before = conversation % engines, (conversation * 7 + 1) % engines
        index.apply(
            home,
            [BlockEvent("stored", "GPU", chain), BlockEvent("stored", "CPU", chain[: CHAIN_BLOCKS // 2])],
        )
        index.apply(before, [BlockEvent("stored", "CPU", chain[: CHAIN_BLOCKS // 2])])


def _per_call(fn, calls: int) -> float:
    # this process's CPU seconds, not the wall clock: on a machine shared with other jobs a
    # single-threaded loop's wall time is mostly the time others held the core
    start = time.process_time()
    fn(calls)
    return (time.process_time() - start) / calls


def measure(engines: int, blocks: int, rounds: int) -> dict:
    conversations = max(1, blocks // CHAIN_BLOCKS)
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex(engines, max_blocks=2 * blocks)
    _fill(index, conversations)
    held = len(index)
    bytes_per_block = tracemalloc.get_traced_memory()[0] / held
    tracemalloc.stop()

    router = PrefixRouter(engines, max_blocks=2 * blocks)
    router.index = index
    plain = {h: h % engines for h in range(SYSTEM_BLOCKS + conversations * CHAIN_BLOCKS)}
    requests = [list(range(SYSTEM_BLOCKS)) + _chain(c * 7919 % conversations) for c in range(SAMPLES)]
    fresh = SYSTEM_BLOCKS + conversations * CHAIN_BLOCKS  # hashes no one holds yet
    batches = [list(range(fresh + i * EVENT_BLOCKS, fresh + (i + 1) * EVENT_BLOCKS)) for i in range(SAMPLES)]
    last = SAMPLES - 1  # batch j belongs to engine j mod N; the last one is held when a round starts
    index.apply(last % engines, [BlockEvent("stored", "GPU", batches[last])])
    plain.update(dict.fromkeys(batches[last], last % engines))

    def update(calls: int) -> None:
        # each call stores a new batch and removes the one before: the index keeps its size
        for i in range(calls):
            index.apply(i % engines, [BlockEvent("stored", "GPU", batches[i])])
            index.apply((i - 1) % engines, [BlockEvent("removed", "GPU", batches[i - 1])])

    def dict_update(calls: int) -> None:
        for i in range(calls):
            for h in batches[i]:
                plain[h] = i % engines
            for h in batches[i - 1]:
                del plain[h]

    def score(calls: int) -> None:
        for i in range(calls):
            index.score(requests[i % SAMPLES])

    def dict_walk(calls: int) -> None:
        get = plain.get
        for i in range(calls):
            for h in requests[i % SAMPLES]:
                get(h)

    rr = RoundRobinRouter(engines)

    def round_robin(calls: int) -> None:
        for i in range(calls):
            rr.route(requests[i % SAMPLES], now_s=float(i))

    def route(calls: int) -> None:
        for i in range(calls):
            router.route(requests[i % SAMPLES], now_s=float(i) / 100)

    figures: dict[str, list[float]] = {}
    for _ in range(rounds):  # the paths alternate within a round: the machine's noise hits all
        for name, fn, scale in (
            ("update_ns_per_block", update, 1e9 / (2 * EVENT_BLOCKS)),
            ("dict_update_ns_per_block", dict_update, 1e9 / (2 * EVENT_BLOCKS)),
            ("score_us", score, 1e6),
            ("dict_walk_us", dict_walk, 1e6),
            ("round_robin_us", round_robin, 1e6),
            ("route_us", route, 1e6),
        ):
            figures.setdefault(name, []).append(_per_call(fn, SAMPLES) * scale)
    result = {"engines": engines, "blocks": held, "bytes_per_block": round(bytes_per_block)}
    result.update({name: median(values) for name, values in figures.items()})
    result["update_vs_dict"] = result["update_ns_per_block"] / result["dict_update_ns_per_block"]
    result["score_vs_dict_walk"] = result["score_us"] / result["dict_walk_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="2,8,32", help="fleet sizes, comma-separated")
    parser.add_argument("--blocks", default="10000,100000,1000000", help="index sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = [
        measure(engines, blocks, args.rounds)
        for blocks in (int(b) for b in args.blocks.split(","))
        for engines in (int(e) for e in args.engines.split(","))
    ]
    columns = [
        "engines",
        "blocks",
        "update_ns_per_block",
        "dict_update_ns_per_block",
        "score_us",
        "dict_walk_us",
        "round_robin_us",
        "route_us",
        "bytes_per_block",
    ]
    print_table(results, columns, sys.stdout)
    print_json(
        {
            "results": results,
            "max_update_vs_dict": max(r["update_vs_dict"] for r in results),
            "max_score_vs_dict_walk": max(r["score_vs_dict_walk"] for r in results),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()

"""``chain`` with its protected share learnt against the same policy with the share fixed:
what the race costs per block reference, and what it buys, on both bundled traces.

    PYTHONPATH=src python benchmarks/bench_chain_share.py [--capacities 1000 10000 100000]
                                                          [--rounds 3] [--json]

Per trace and capacity, in the same process, rounds interleaved: the planner's simulation
(bookkeeping only, the manager's calls) of LRU, ``chain`` at each fixed share in
``SHARES`` (the baseline: the same policy without the race), and ``chain`` learning its
share. Speed is block references per CPU second, median of ``--rounds``; ``overhead`` is
the learnt policy's time per reference over the fastest fixed share's. Hit ratios are
deterministic. The race samples one key in up to 32 (fewer as the tier shrinks, never
shadows under 64 blocks), so its cost per reference falls as the capacity grows until
the 1/32 floor; the table shows it at each size. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvtier.bench.report import print_json, print_table
from kvtier.plan.simulate import simulate
from kvtier.policies.chain import SHARES, ChainPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.replay.trace import BUNDLED_TRACES, load_trace


def contenders(capacity: int) -> dict[str, object]:
    makers: dict[str, object] = {"lru": lambda: LRUPolicy(capacity)}
    for share in SHARES:
        makers[f"fixed {share}"] = lambda share=share: ChainPolicy(capacity, share)
    makers["learnt"] = lambda: ChainPolicy(capacity)
    return makers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.capacities) < 1:
        parser.error("--rounds and every --capacities value must be at least 1")
    rows = []
    for trace in BUNDLED_TRACES:
        chains = [request.hash_ids for request in load_trace(trace)]
        for capacity in args.capacities:
            makers = contenders(capacity)
            speed: dict[str, list[float]] = {name: [] for name in makers}
            ratio: dict[str, float] = {}
            share = changes = None
            for _ in range(args.rounds):
                for name, make in makers.items():
                    policy = make()
                    result = simulate(chains, policy, capacity)
                    speed[name].append(result.refs / result.seconds)
                    ratio[name] = round(result.hit_ratio, 4)
                    if name == "learnt":
                        share, changes = policy.protected_share, policy.share_changes
            median = {name: statistics.median(values) for name, values in speed.items()}
            fastest_fixed = max(median[f"fixed {s}"] for s in SHARES)
            best_fixed = max(ratio[f"fixed {s}"] for s in SHARES)
            rows.append(
                {
                    "trace": trace,
                    "capacity": capacity,
                    "lru": ratio["lru"],
                    **{f"fixed_{s}": ratio[f"fixed {s}"] for s in SHARES},
                    "learnt": ratio["learnt"],
                    "learnt_minus_lru": round(ratio["learnt"] - ratio["lru"], 4),
                    "learnt_minus_best_fixed": round(ratio["learnt"] - best_fixed, 4),
                    "final_share": share,
                    "share_changes": changes,
                    "learnt_refs_per_s": round(median["learnt"]),
                    "fixed_refs_per_s": round(fastest_fixed),
                    "overhead": round(fastest_fixed / median["learnt"], 2),
                }
            )
    if not args.json:
        columns = [
            "trace",
            "capacity",
            "lru",
            *(f"fixed_{s}" for s in SHARES),
            "learnt",
            "final_share",
            "learnt_refs_per_s",
            "fixed_refs_per_s",
            "overhead",
        ]
        print_table(rows, columns, sys.stdout)
    print_json(
        {
            "bench": "chain_share",
            "rows": rows,
            "worst_learnt_minus_lru": min(row["learnt_minus_lru"] for row in rows),
            "worst_learnt_minus_best_fixed": min(row["learnt_minus_best_fixed"] for row in rows),
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

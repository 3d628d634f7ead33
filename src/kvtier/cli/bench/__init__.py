"""``kvtier bench TARGET``: benchmarks, each against a baseline measured in the same run.

One module per target, each with ``add_parser(sub)`` and ``run(args) -> int``.
"""

from __future__ import annotations

from typing import Any

from kvtier.cli.bench import cascade, codec, disk, manager, remote, transfer

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """``kvtier bench``: its targets, in the order ``--help`` lists them."""
    bench = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    targets = bench.add_subparsers(dest="bench_command", required=True, metavar="TARGET")
    for target in (manager, transfer, disk, remote, cascade, codec):
        target.add_parser(targets)

"""``kvtier``: check configurations and measure the tiers from the command line.

This module only wires the commands; each lives in its own module (``kvtier.cli.<command>``)
with ``add_parser(sub)`` (its options) and ``run(args) -> int`` (its exit status).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier.cli import bench, check, config, plan, replay, soak

#: the commands, in the order ``kvtier --help`` lists them
COMMANDS = (replay, plan, config, check, soak, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading for LLM engines: check configs, benchmark tiers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

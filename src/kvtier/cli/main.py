"""``kvtier``: check configurations and measure the tiers from the command line.

This module only wires the commands; each lives in its own module (``kvtier.cli.<command>``)
with ``add_parser(sub)`` (its options) and ``run(args) -> int`` (its exit status). Every
command runs under :func:`~kvtier.cli.signals.stop_on_signals`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from kvtier.cli import bench, check, config, generate, model, plan, replay, soak, stats
from kvtier.cli.signals import Stopped, stop_on_signals

#: the commands, in the order ``kvtier --help`` lists them
COMMANDS = (replay, plan, model, generate, config, check, stats, soak, bench)


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading for LLM engines: check configs, benchmark tiers.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None, table_and_json: bool = False) -> int:
    """Run the command of ``argv`` (default: the process's); its exit status.

    ``table_and_json``: a benchmark script's output (``benchmarks/``): the table, then the
    JSON line, where a command prints only one of them (the JSON line with ``--json``).
    """
    args = build_parser().parse_args(argv)
    args.table_and_json = table_and_json
    try:
        with stop_on_signals():
            return args.func(args)
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"kvtier: stopped by {name}; temporary stores and the CPU region removed", file=sys.stderr)
        return 128 + stopped.signum  # what a shell reports for a process the signal ended


if __name__ == "__main__":
    sys.exit(main())

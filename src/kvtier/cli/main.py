"""``kvtier``: check configurations and measure the tiers from the command line.

This module only wires the commands; each lives in its own module (``kvtier.cli.<command>``)
with ``add_parser(sub)`` (its options) and ``run(args) -> int`` (its exit status). Every
command runs under :func:`~kvtier.cli.signals.stop_on_signals`.
"""

from __future__ import annotations

import argparse
import os
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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None, table_and_json: bool = False) -> int:
    """Run the command of ``argv`` (default: the process's); its exit status.

    ``table_and_json``: a benchmark script's output (``benchmarks/``): the table, then the
    JSON line, where a command prints only one of them (the JSON line with ``--json``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `kvtier`: what there is to run, not a usage error
        parser.print_help()
        return 0
    args.table_and_json = table_and_json
    try:
        with stop_on_signals():
            status = args.func(args)
            sys.stdout.flush()  # a reader gone shows here, not as an error in Python's exit
            return status
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"kvtier: stopped by {name}; temporary stores and the CPU region removed", file=sys.stderr)
        return 128 + stopped.signum  # what a shell reports for a process the signal ended
    except BrokenPipeError:
        # the reader left (`kvtier stats FILE | head`): stop quietly, as a shell tool does. The
        # stack's own cleanup already ran as the error unwound; stdout goes to /dev/null so
        # that Python's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

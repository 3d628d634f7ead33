"""``kvtier config check FILE``: parse a configuration and print its tier stack, or the error;
then check it against this machine (a disk tier's capacity against the room on its disk),
strictly: an engine opens such a tier all the same and counts what it cannot store."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier config``: its actions (``check``)."""
    config = sub.add_parser("config", help="work with configuration files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser(
        "check",
        help="parse FILE and print the tier stack, or the error (a disk tier's capacity beyond "
        "the room on its disk is one)",
    )
    check.add_argument("file", metavar="FILE", help="a kvtier YAML configuration")
    check.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import describe, load_config

    try:
        config = load_config(args.file)
    except KvtierError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 1
    problems = [
        problem
        for index, tier in enumerate(config.tiers)
        for problem in tier.host_problems(f"tiers[{index}]")
    ]
    for problem in problems:
        print(f"{args.file}: does not fit this machine: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.file}: valid")
    print(describe(config))
    return 0

"""``kvtier config check FILE``: parse a configuration and print its tier stack, or the error.

Beyond parsing, it checks the files the configuration names as the engine would at start
(each tier's ``secret_file``, the metrics section's stats file and Unix socket), reading
them only: what would fail the start fails the check. It also checks a disk tier's capacity
against the room on its disk, strictly: an engine opens such a tier all the same, warns, and
counts what it cannot store.
"""

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
        help="parse FILE and check it as the engine would at start (the secrets, stats file and "
        "metrics socket it names; a disk tier's capacity beyond the room on its disk); print the "
        "tier stack, or the error",
    )
    check.add_argument(
        "file", nargs="?", metavar="FILE", help="a kvtier YAML configuration (default: $KVTIER_CONFIG)"
    )
    check.set_defaults(func=run)


def _check_named_files(config: Any) -> None:
    """What the engine would refuse at start about the files ``config`` names (nothing is
    created or written)."""
    from kvtier.metrics.report import check_reporting
    from kvtier.tiers.secret import read_secret_file

    for index, tier in enumerate(config.tiers):
        secret_file = getattr(tier, "secret_file", None)
        if secret_file is not None:
            read_secret_file(secret_file, f"tiers[{index}].secret_file")
    check_reporting(config.metrics)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import CONFIG_ENV, describe, env_config_path, load_config

    args.file = args.file or env_config_path()
    if args.file is None:
        print(f"kvtier config check: give FILE, or set {CONFIG_ENV} to its path", file=sys.stderr)
        return 2
    try:
        config = load_config(args.file)
        _check_named_files(config)
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

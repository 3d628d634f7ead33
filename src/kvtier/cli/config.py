"""``kvtier config check FILE``: parse a configuration and print its tier stack, or the error."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier config``: its actions (``check``)."""
    config = sub.add_parser("config", help="work with configuration files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="parse FILE and print the tier stack, or the error")
    check.add_argument(
        "file", nargs="?", metavar="FILE", help="a kvtier YAML configuration (default: $KVTIER_CONFIG)"
    )
    check.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import CONFIG_ENV, describe, env_config_path, load_config

    args.file = args.file or env_config_path()
    if args.file is None:
        print(f"kvtier config check: give FILE, or set {CONFIG_ENV} to its path", file=sys.stderr)
        return 2
    try:
        config = load_config(args.file)
    except KvtierError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: valid")
    print(describe(config))
    return 0

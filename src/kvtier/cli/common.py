"""What several commands share: report-or-JSON printing, the password warning, disk kinds,
options and their bounds."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from typing import Any, TextIO

from kvtier.bench.report import print_json

__all__ = [
    "add_secrets_option",
    "add_trace_argument",
    "count",
    "disk_kinds",
    "report",
    "warn_password_in_url",
]


def report(args: argparse.Namespace, run: Callable[[TextIO], dict[str, Any]]) -> dict[str, Any]:
    """Run a reporter (its text, on the stream it is given); its JSON record.

    Every command's one output rule: a person gets the reporter's tables on stdout, and with
    ``--json`` stdout carries the record as one JSON line and nothing else. A benchmark script
    (``benchmarks/``, ``args.table_and_json``: see :func:`~kvtier.cli.main.main`) prints both.
    """
    record = run(io.StringIO() if args.json else sys.stdout)
    if args.json or getattr(args, "table_and_json", False):
        print_json(record, sys.stdout)
    return record


def count(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high`` (no bound without one);
    anything else is argparse's usage error naming the option, exit 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of {low} or more"
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a number {bounds}")
        return value

    return parse


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """The optional TRACE of ``replay`` and ``plan``: a file, or a bundled trace by name."""
    from kvtier.replay.trace import BUNDLED_TRACES

    default, *others = BUNDLED_TRACES
    parser.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE",
        help="a Mooncake-format trace (.jsonl or .jsonl.gz), or a bundled one by name: "
        f"{default} (the default), {', '.join(others)}",
    )


def add_secrets_option(parser: argparse.ArgumentParser, keyed: str) -> None:
    """``--secrets`` of the tier benchmarks; ``keyed`` says what a secret keys on that tier."""
    parser.add_argument(
        "--secrets",
        action="store_true",
        help=f"also measure the tier with a secret_file ({keyed}) and with encrypt: aes-gcm, "
        "side by side; *_cost = 1 - rate / the plain tier's (needs the cryptography package)",
    )


def warn_password_in_url(url: str | None, command: str) -> None:
    """Say so when a password came on the command line: every local user sees it in ps."""
    from urllib.parse import urlsplit

    if not url or "://" not in url:
        return
    try:
        has_password = urlsplit(url).password is not None or "password=" in url.lower()
    except ValueError:
        return
    if has_password:
        print(
            f"kvtier {command}: warning: a password in a URL on the command line is visible to every "
            "local user (ps): put it in a file of mode 0600 named by a valkey tier's password_file: "
            "(kvtier check --config FILE), or in KVTIER_VALKEY_PASSWORD",
            file=sys.stderr,
        )


def disk_kinds() -> list[str]:
    """The registered kinds whose section is the disk tiers' (what ``--disk``/``--backend`` take)."""
    from kvtier.config import TIER_KINDS
    from kvtier.tiers.disk.config import DiskTierConfig

    return [
        kind
        for kind in TIER_KINDS.names()
        if issubclass(TIER_KINDS.resolve(kind, field="kind"), DiskTierConfig)
    ]

"""``kvtier``: check configurations and measure the tiers from the command line."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence

from kvtier.errors import KvtierError


def _config_check(args: argparse.Namespace) -> int:
    from kvtier.config import describe, load_config

    try:
        config = load_config(args.file)
    except KvtierError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: valid")
    print(describe(config))
    return 0


def _bench_manager(args: argparse.Namespace) -> int:
    from kvtier.bench import manager

    out = io.StringIO() if args.json else sys.stdout
    record = manager.run(num_keys=args.keys, capacity=args.capacity, runs=args.runs, out=out)
    if args.json:
        lines = out.getvalue().rstrip("\n").splitlines()
        print(lines[-1])
    return 0 if record["rows"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading for LLM engines: check configs, benchmark tiers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="work with configuration files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="parse FILE and print the tier stack, or the error")
    check.add_argument("file", metavar="FILE", help="a kvtier YAML configuration")
    check.set_defaults(func=_config_check)

    bench = commands.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="TARGET")
    bench_manager = bench_commands.add_parser(
        "manager", help="scheduler-side cost per block of the single-tier manager, LRU and ARC"
    )
    bench_manager.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_manager.add_argument("--keys", type=int, default=100_000, help="distinct keys stored (default 100000)")
    bench_manager.add_argument("--capacity", type=int, default=50_000, help="tier size in blocks (default 50000)")
    bench_manager.add_argument("--runs", type=int, default=5, help="runs per figure; the median is kept (default 5)")
    bench_manager.set_defaults(func=_bench_manager)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

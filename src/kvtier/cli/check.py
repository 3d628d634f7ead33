"""``kvtier check``: verify a disk tier's store, or a shared valkey tier's values per namespace.

Its exit statuses are fsck(8)'s, so that scripts and units written for fsck read them alike:
0 healthy, 1 problems found and all fixed (``--fix``), 4 problems left (found without
``--fix``, or still there after it), 8 the check could not run (not a store, a server out of
reach, a refused secret); 2 is a mistake on the command line, as for every command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kvtier.cli.common import warn_password_in_url
from kvtier.errors import ConfigError, KvtierError


#: exit statuses (fsck's): healthy, every problem fixed, problems left, could not check
CLEAN, FIXED, PROBLEMS_LEFT, CANNOT_CHECK = 0, 1, 4, 8


def add_parser(sub: Any) -> None:
    """``kvtier check``: its options."""
    check_path = sub.add_parser(
        "check",
        help="verify a disk tier's store, or a shared valkey tier's values (exit as fsck: 0 healthy, "
        "1 fixed, 4 problems left, 8 could not check)",
        description="Read and verify every block of the disk-tier store at PATH (its manifest says "
        "which kind and layout); report what is wrong. Safe while an engine uses the store. "
        "Given a server URL (valkey://HOST:PORT[/DB], valkeys:// for TLS, redis://, rediss://, "
        "unix:///path) or --cluster, read every value of the shared tier's namespaces with SCAN and "
        "pipelined GETs and verify each against its own header (decodes, names the key in the "
        "value's name, payload length and checksum hold) and its namespace (one layout digest); "
        "report per namespace. Safe while engines use the tier. Exit status as fsck's: 0 healthy, "
        "1 problems found and all fixed (--fix checks again after repairing), 4 problems left, "
        "8 could not check, 2 a bad command line.",
    )
    check_path.add_argument(
        "path",
        nargs="?",
        metavar="PATH|URL",
        help="the store directory (a disk tier's path:), or a server URL (valkey://HOST:PORT[/DB])",
    )
    check_path.add_argument(
        "--fix", action="store_true", help="drop bad blocks and repair the index (valkey: DEL bad values)"
    )
    check_path.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    check_path.add_argument(
        "--namespace",
        metavar="NS",
        help="valkey: check only the values NS:<key> (default: every kvtier:* namespace, i.e. every tier "
        "whose namespace was derived from its layout; name a tier's own namespace: to check it)",
    )
    check_path.add_argument(
        "--config",
        metavar="FILE",
        help="valkey: check the shared tier a kvtier YAML names (its url or cluster_nodes, username, "
        "password_file, tls and namespace), instead of a URL (default, when no PATH|URL is given "
        "either: $KVTIER_CONFIG)",
    )
    check_path.add_argument(
        "--tier", metavar="NAME", help="valkey: with --config, which valkey tier (if several)"
    )
    check_path.add_argument(
        "--layout",
        metavar="DIGEST",
        help="valkey: the layout digest (32 hex digits) every value of the namespace must carry; "
        "without it a namespace whose values carry several layouts is reported and none of those "
        "values is deleted, whatever their numbers (default namespaces kvtier:<digest> name theirs)",
    )
    check_path.add_argument(
        "--cluster",
        metavar="HOST:PORT,...",
        help="valkey: a cluster, instead of a URL: some of its nodes (the rest are discovered)",
    )
    check_path.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the tier's secret_file: verify keyed blocks/values (without it, a store of keyed blocks "
        "reports them as problems and --fix is refused; keyed values on a server are counted unverified)",
    )
    check_path.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from kvtier.config.load import env_config_path
    from kvtier.tiers.disk import check_store
    from kvtier.tiers.valkey.check import is_valkey_target

    if not (args.path or args.cluster or args.config):
        args.config = env_config_path()
    if args.cluster or args.config or (args.path and is_valkey_target(args.path)):
        return _check_valkey(args)
    for option, value in (("--namespace", args.namespace), ("--layout", args.layout), ("--tier", args.tier)):
        if value is not None:
            print(
                f"kvtier check: {option} is for a server (valkey://HOST:PORT), not the store {args.path!r}",
                file=sys.stderr,
            )
            return 2
    if args.path is None:
        print(
            "kvtier check: give a store directory, a server URL (valkey://HOST:PORT[/DB]), "
            "--cluster HOST:PORT,... or --config FILE (or set KVTIER_CONFIG)",
            file=sys.stderr,
        )
        return 2
    try:
        report = check_store(args.path, fix=args.fix, secret_file=args.secret_file)
        status, left = _status(report, args.fix, lambda: check_store(args.path, secret_file=args.secret_file))
    except KvtierError as exc:
        if args.json:
            print(json.dumps({"path": args.path, "healthy": False, "error": str(exc)}, sort_keys=True))
        else:
            print(f"{args.path}: cannot check: {exc}", file=sys.stderr)
        return CANNOT_CHECK
    if args.json:
        print(
            json.dumps(
                {
                    "path": report.tier,
                    "healthy": report.healthy,
                    "blocks_checked": report.blocks_checked,
                    "problems": report.problems,
                    "fixed": report.fixed,
                    "problems_left": left,
                },
                sort_keys=True,
            )
        )
    else:
        state = "healthy" if report.healthy else f"{len(report.problems)} problems"
        print(f"{report.tier}: {report.blocks_checked} blocks checked, {state}")
        for problem in report.problems:
            print(f"  problem: {problem}")
        for fixed in report.fixed:
            print(f"  fixed: {fixed}")
        _print_left(args.fix, report.healthy, left, "  ")
    return status


def _status(report: Any, fix: bool, check_again: Callable[[], Any]) -> tuple[int, list[str]]:
    """fsck's exit status for ``report``, and the problems left.

    Without ``fix`` every problem found is left. After a repair the store (or server) is
    checked again, read-only, and what that check finds is left: the status then says
    what holds now, not what the repair meant to do. A healthy first check is not repeated.
    """
    if report.healthy:
        return CLEAN, []
    if not fix:
        return PROBLEMS_LEFT, list(report.problems)
    left = list(check_again().problems)
    return (PROBLEMS_LEFT if left else FIXED), left


def _print_left(fix: bool, healthy: bool, left: list[str], indent: str) -> None:
    """After a repair: what the check that followed it found."""
    if not fix or healthy:
        return
    print(f"{indent}after --fix: " + (f"{len(left)} problems left" if left else "healthy"))
    for problem in left:
        print(f"{indent}  left: {problem}")


def _valkey_tier_of(path: str, name: str | None):
    """The valkey tier named ``name`` (or the only one) of the configuration at ``path``."""
    from kvtier.config import load_config
    from kvtier.tiers.valkey.config import ValkeyTierConfig

    config = load_config(path)
    tiers = [tier for tier in config.tiers if isinstance(tier, ValkeyTierConfig)]
    if name is not None:
        tiers = [tier for tier in tiers if tier.name == name]
    if len(tiers) != 1:
        names = [tier.name for tier in config.tiers if isinstance(tier, ValkeyTierConfig)]
        raise ConfigError(
            "--tier",
            name,
            f"the name of one valkey tier of {path} (it has: {', '.join(names) or 'none'})",
            "give --tier NAME" if names else "give a configuration with a kind: valkey tier",
        )
    return tiers[0]


def _layout_digest(text: str | None) -> bytes | None:
    """``--layout``'s digest (32 hex digits, as a check report prints it), or None."""
    if text is None:
        return None
    try:
        digest = bytes.fromhex(text)
    except ValueError:
        digest = b""
    if len(digest) != 16:
        raise ConfigError(
            "--layout",
            text,
            "a layout digest: 32 hex digits",
            "copy it from the report's layout_digests (kvtier check URL --namespace NS --json)",
        )
    return digest


def _check_valkey(args: argparse.Namespace) -> int:
    """``kvtier check valkey://...`` (or ``--cluster``): the shared tier's values, per namespace."""
    import json

    from kvtier.errors import ValkeyCheckError
    from kvtier.tiers.valkey.check import check_valkey
    from kvtier.tiers.valkey.config import redact_url

    nodes = [node.strip() for node in args.cluster.split(",") if node.strip()] if args.cluster else []
    target = args.cluster or redact_url(args.path) or args.config
    if sum(map(bool, (args.cluster, args.path, args.config))) > 1:
        print("kvtier check: give one of a server URL, --cluster and --config", file=sys.stderr)
        return 2
    warn_password_in_url(args.path, "check")
    try:  # the command line's own values: a mistake in them is bad input (2), not a failed check
        layout = _layout_digest(args.layout)
        tier = _valkey_tier_of(args.config, args.tier) if args.config else None
    except KvtierError as exc:
        print(f"kvtier check: {exc}", file=sys.stderr)
        return 2
    if tier is not None:
        target = tier.location()

    def check(fix: bool) -> Any:
        return check_valkey(
            args.path,
            cluster_nodes=nodes,
            namespace=args.namespace,
            fix=fix,
            layout_digest=layout,
            config=tier,
            secret_file=args.secret_file,
        )

    try:
        report = check(args.fix)
        status, left = _status(report, args.fix, lambda: check(False))
    except (KvtierError, ImportError) as exc:
        if args.json:
            print(json.dumps({"path": target, "healthy": False, "error": str(exc)}, sort_keys=True))
        elif isinstance(exc, ValkeyCheckError):  # its message starts with the target already
            print(f"cannot check {exc}", file=sys.stderr)
        else:
            print(f"{target}: cannot check: {exc}", file=sys.stderr)
        return CANNOT_CHECK
    if args.json:
        print(json.dumps({**report.to_record(), "problems_left": left}, sort_keys=True))
        return status
    state = "healthy" if report.healthy else f"{len(report.problems)} problems"
    print(
        f"{report.target}: {len(report.namespaces)} namespaces, {report.blocks_checked} blocks checked, {state}"
    )
    for found in report.namespaces:
        state = "healthy" if found.healthy else f"{len(found.problems)} problems"
        print(
            f"  {found.namespace}: {found.blocks_checked} blocks, {found.value_bytes} bytes, "
            f"layout {found.layout_digest or '-'}, {state}"
        )
        if found.unverified:
            print(f"    unverified: {found.unverified} keyed values (give --secret-file to verify them)")
        if len(found.layout_digests) > 1:
            print("    layouts found: " + ", ".join(f"{d} ({n})" for d, n in found.layout_digests.items()))
        for problem in found.problems:
            print(f"    problem: {problem}")
        for fixed in found.fixed:
            print(f"    fixed: {fixed}")
    _print_left(args.fix, report.healthy, left, "  ")
    return status

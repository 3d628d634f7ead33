"""``kvtier``: check configurations and measure the tiers from the command line."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from kvtier.bench.report import print_json
from kvtier.errors import ConfigError, KvtierError


def _report(args: argparse.Namespace, run: Callable[[TextIO], dict[str, Any]]) -> dict[str, Any]:
    """Run a reporter (table, then JSON line, on the stream it is given); its JSON record.

    With ``--json`` only the JSON line reaches stdout: every reporter's last line is
    ``print_json(record)``, so printing the returned record gives the same line.
    """
    if not args.json:
        return run(sys.stdout)
    record = run(io.StringIO())
    print_json(record, sys.stdout)
    return record


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


def _replay(args: argparse.Namespace) -> int:
    from kvtier.replay.run import replay

    if args.engines is not None:
        if args.deterministic:
            print("kvtier replay: --deterministic is for one engine; engine processes sharing a "
                  "server interleave as the OS schedules them (drop --engines or --deterministic)",
                  file=sys.stderr)
            return 2
        if args.device != "cpu":
            print("kvtier replay: --engines runs each engine's cache as CPU tensors (the fleet "
                  "measures the shared tier, not the GPU copies); drop --device or --engines",
                  file=sys.stderr)
            return 2
        return _replay_fleet(args)
    try:
        record = _report(args, lambda out: replay(
            args.trace,
            args.config,
            gpu_blocks=args.gpu_blocks,
            block_bytes=args.block_bytes,
            limit=args.limit,
            baseline=not args.no_baseline,
            progress=not args.no_progress,
            plot=args.plot,
            disk_kind=args.disk,
            out=out,
            device=args.device,
            deterministic=args.deterministic,
        ))  # the JSON line only with --json (printed by _report): a person gets the table
    except KvtierError as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    # Wrong bytes served is the one outcome a replay must never show; corrupt blocks found
    # (and dropped) by a tier are a counted miss, not a failure.
    return 1 if record["mismatched_blocks"] else 0


def _replay_fleet(args: argparse.Namespace) -> int:
    from kvtier.replay.fleet import replay_fleet

    nodes = [node.strip() for node in args.valkey_cluster.split(",")] if args.valkey_cluster else None
    _warn_password_in_url(args.valkey, "replay")
    try:
        record = _report(args, lambda out: replay_fleet(
            args.trace, args.config, engines=args.engines, valkey_url=args.valkey, cluster_nodes=nodes,
            gpu_blocks=args.gpu_blocks, block_bytes=args.block_bytes, limit=args.limit, out=out,
        ))
    except (KvtierError, OSError, ImportError) as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    return 1 if record["mismatched_blocks"] else 0


def _plan(args: argparse.Namespace) -> int:
    from kvtier.plan.run import plan

    try:
        _report(args, lambda out: plan(
            args.trace,
            capacities=args.capacities,
            policies=args.policies,
            target=args.target,
            cpu_target=args.cpu_target,
            block_bytes=args.block_bytes,
            plot=args.plot,
            out=out,
            admission_policy=args.admission_policy,
            min_reuse=args.min_reuse,
            signals=args.signals,
            jobs=args.jobs,
        ))
    except KvtierError as exc:
        print(f"kvtier plan: {exc}", file=sys.stderr)
        return 2
    return 0


def _check(args: argparse.Namespace) -> int:
    import json

    from kvtier.tiers.disk import check_store
    from kvtier.tiers.valkey.check import is_valkey_target

    if args.cluster or args.config or (args.path and is_valkey_target(args.path)):
        return _check_valkey(args)
    for option, value in (("--namespace", args.namespace), ("--layout", args.layout), ("--tier", args.tier)):
        if value is not None:
            print(f"kvtier check: {option} is for a server (valkey://HOST:PORT), not the store {args.path!r}",
                  file=sys.stderr)
            return 2
    if args.path is None:
        print("kvtier check: give a store directory, a server URL (valkey://HOST:PORT[/DB]) or "
              "--cluster HOST:PORT,...", file=sys.stderr)
        return 2
    try:
        report = check_store(args.path, fix=args.fix, secret_file=args.secret_file)
    except KvtierError as exc:
        if args.json:
            print(json.dumps({"path": args.path, "healthy": False, "error": str(exc)}, sort_keys=True))
        else:
            print(f"{args.path}: cannot check: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(
            {"path": report.tier, "healthy": report.healthy, "blocks_checked": report.blocks_checked,
             "problems": report.problems, "fixed": report.fixed},
            sort_keys=True,
        ))
    else:
        state = "healthy" if report.healthy else f"{len(report.problems)} problems"
        print(f"{report.tier}: {report.blocks_checked} blocks checked, {state}")
        for problem in report.problems:
            print(f"  problem: {problem}")
        for fixed in report.fixed:
            print(f"  fixed: {fixed}")
    return 0 if report.healthy else 1


def _warn_password_in_url(url: str | None, command: str) -> None:
    """Say so when a password came on the command line: every local user sees it in ps."""
    from urllib.parse import urlsplit

    if not url or "://" not in url:
        return
    try:
        has_password = urlsplit(url).password is not None or "password=" in url.lower()
    except ValueError:
        return
    if has_password:
        print(f"kvtier {command}: warning: a password in a URL on the command line is visible to every "
              "local user (ps); put it in KVTIER_VALKEY_PASSWORD, or in a password_file: of the "
              "tier's config (kvtier check --config FILE)", file=sys.stderr)


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
            "--tier", name, f"the name of one valkey tier of {path} (it has: {', '.join(names) or 'none'})",
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
            "--layout", text, "a layout digest: 32 hex digits",
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
    _warn_password_in_url(args.path, "check")
    try:
        layout = _layout_digest(args.layout)
        tier = _valkey_tier_of(args.config, args.tier) if args.config else None
        if tier is not None:
            target = tier.location()
        report = check_valkey(
            args.path, cluster_nodes=nodes, namespace=args.namespace, fix=args.fix, layout_digest=layout,
            config=tier, secret_file=args.secret_file,
        )
    except (KvtierError, ImportError) as exc:
        if args.json:
            print(json.dumps({"path": target, "healthy": False, "error": str(exc)}, sort_keys=True))
        elif isinstance(exc, ValkeyCheckError):  # its message starts with the target already
            print(f"cannot check {exc}", file=sys.stderr)
        else:
            print(f"{target}: cannot check: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_record(), sort_keys=True))
        return 0 if report.healthy else 1
    state = "healthy" if report.healthy else f"{len(report.problems)} problems"
    print(f"{report.target}: {len(report.namespaces)} namespaces, {report.blocks_checked} blocks checked, {state}")
    for found in report.namespaces:
        state = "healthy" if found.healthy else f"{len(found.problems)} problems"
        print(f"  {found.namespace}: {found.blocks_checked} blocks, {found.value_bytes} bytes, "
              f"layout {found.layout_digest or '-'}, {state}")
        if found.unverified:
            print(f"    unverified: {found.unverified} keyed values (give --secret-file to verify them)")
        if len(found.layout_digests) > 1:
            print("    layouts found: " + ", ".join(f"{d} ({n})" for d, n in found.layout_digests.items()))
        for problem in found.problems:
            print(f"    problem: {problem}")
        for fixed in found.fixed:
            print(f"    fixed: {fixed}")
    return 0 if report.healthy else 1


def _bench_disk(args: argparse.Namespace) -> int:
    from kvtier.bench import disk

    try:
        _report(args, lambda out: disk.run(
            backend=args.backend, gib=args.gib, threads=args.threads, directory=args.dir,
            rounds=args.rounds, open_blocks=args.open_blocks, drop_caches=not args.no_drop_caches,
            fsync=args.fsync, secrets=args.secrets, out=out,
        ))
    except (KvtierError, RuntimeError, OSError) as exc:
        # a block that failed to store or load, or came back different, ends the run
        print(f"kvtier bench disk: {exc}", file=sys.stderr)
        return 1
    return 0


def _bench_manager(args: argparse.Namespace) -> int:
    if args.stack:
        from kvtier.bench import manager_stack

        try:
            sizes = [int(size) for size in args.sizes.split(",")]
        except ValueError:
            print(f"kvtier bench manager: --sizes {args.sizes!r}: give block counts like 10000,100000", file=sys.stderr)
            return 2
        try:
            record = _report(args, lambda out: manager_stack.run(
                sizes=sizes, steps=args.steps, runs=args.runs, out=out
            ))
        except KvtierError as exc:
            print(f"kvtier bench manager: {exc}", file=sys.stderr)
            return 2
        return 0 if record["us_per_step"] else 1
    from kvtier.bench import manager

    record = _report(
        args, lambda out: manager.run(num_keys=args.keys, capacity=args.capacity, runs=args.runs, out=out)
    )
    return 0 if record["rows"] else 1


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvtier.bench import transfer

    record = _report(args, lambda out: transfer.run(
        device=args.device, max_batch=args.max_batch, runs=args.runs, layers=args.layers, out=out,
        kernel=not args.no_kernel,
    ))
    return 0 if record["rows"] and record["verified"] else 1


def _disk_kinds() -> list[str]:
    """The registered kinds whose section is the disk tiers' (what ``--disk``/``--backend`` take)."""
    from kvtier.config import TIER_KINDS
    from kvtier.tiers.disk.config import DiskTierConfig

    return [
        kind for kind in TIER_KINDS.names()
        if issubclass(TIER_KINDS.resolve(kind, field="kind"), DiskTierConfig)
    ]


def _soak(args: argparse.Namespace) -> int:
    from kvtier.soak.run import run

    try:
        record = _report(args, lambda out: run(
            minutes=args.minutes, faults=args.faults, kind=args.kind, directory=args.dir, seed=args.seed, out=out,
        ))
    except KvtierError as exc:
        print(f"kvtier soak: {exc}", file=sys.stderr)
        return 2
    # a wrong byte served or a committed block lost is the failure a soak exists to catch
    return 1 if record["wrong_blocks_served"] or record["committed_blocks_lost"] else 0


def _bench_remote(args: argparse.Namespace) -> int:
    from kvtier.bench import remote

    _warn_password_in_url(args.url, "bench remote")
    try:
        _report(args, lambda out: remote.run(
            mib=args.mib, rounds=args.rounds, url=args.url, out=out, allow_nonempty=args.allow_nonempty,
            secrets=args.secrets,
        ))
    except (KvtierError, RuntimeError, OSError, ImportError) as exc:
        # no server binary or client, or a block that failed or came back different
        print(f"kvtier bench remote: {exc}", file=sys.stderr)
        return 1
    return 0


def _bench_cascade(args: argparse.Namespace) -> int:
    from kvtier.bench import cascade

    try:
        record = _report(args, lambda out: cascade.run(trace=args.trace, limit=args.limit, out=out))
    except KvtierError as exc:
        print(f"kvtier bench cascade: {exc}", file=sys.stderr)
        return 2
    # a wrong byte served by any stack fails the run, as in kvtier replay
    return 1 if any(stack["mismatched_blocks"] for stack in record["stacks"].values()) else 0


def build_parser() -> argparse.ArgumentParser:
    disk_kinds = _disk_kinds()
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading for LLM engines: check configs, benchmark tiers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from kvtier.tiers.disk.config import FSYNC_CHOICES


    replay = commands.add_parser(
        "replay",
        help="replay a request trace through the real tier stack, verifying every loaded block",
        description="Replay a Mooncake-format trace (default: the bundled one) through a simulated "
        "engine over the real manager, tiers and bytes; print hits per tier and one JSON line.",
    )
    replay.add_argument("trace", nargs="?", metavar="TRACE", help="JSONL trace (default: bundled Mooncake trace)")
    replay.add_argument("--config", metavar="CFG", help="kvtier YAML (default: CPU + disk tier in a temp folder)")
    replay.add_argument("--gpu-blocks", type=int, default=2000, help="blocks in the simulated GPU cache (default 2000)")
    replay.add_argument(
        "--block-bytes", type=int, default=16 * 1024, help="payload bytes per block (default 16384)"
    )
    replay.add_argument("--limit", type=int, help="replay only the first N requests")
    replay.add_argument("--disk", choices=disk_kinds, default="lmdb", help="disk tier kind of the default stack")
    replay.add_argument("--no-baseline", action="store_true", help="skip the CPU-tier-only comparison run")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument("--deterministic", action="store_true",
                        help="each step waits for its copies and tier jobs: the same figures every "
                        "run (the hits per tier too), a little slower")
    replay.add_argument(
        "--plot", metavar="FILE.png",
        help="draw the hit ratio per tier over time, the ceiling, and the CPU-tier-only run",
    )
    replay.add_argument("--json", action="store_true", help="print only the JSON line")
    replay.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="cpu",
        help="where the simulated GPU cache lives: CPU tensors (default), cuda, or cuda if available (auto)",
    )
    replay.add_argument(
        "--engines", type=int, metavar="N",
        help="a fleet: N engine processes, requests dealt round-robin, run with a shared valkey tier and "
        "with local disks only (--config is then each engine's local stack)",
    )
    replay.add_argument("--valkey", metavar="URL", help="the fleet's shared server (default: a local valkey-server)")
    replay.add_argument("--valkey-cluster", metavar="HOST:PORT,...", help="the fleet's shared cluster, instead of --valkey")
    replay.set_defaults(func=_replay)

    _add_plan(commands)

    config = commands.add_parser("config", help="work with configuration files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="parse FILE and print the tier stack, or the error")
    check.add_argument("file", metavar="FILE", help="a kvtier YAML configuration")
    check.set_defaults(func=_config_check)

    check_path = commands.add_parser(
        "check",
        help="verify a disk tier's store, or a shared valkey tier's values (exit 0 healthy, 1 problems found)",
        description="Read and verify every block of the disk-tier store at PATH (its manifest says "
        "which kind and layout); report what is wrong. Safe while an engine uses the store. "
        "Given a server URL (valkey://HOST:PORT[/DB], valkeys:// for TLS, redis://, rediss://, "
        "unix:///path) or --cluster, read every value of the shared tier's namespaces with SCAN and "
        "pipelined GETs and verify each against its own header (decodes, names the key in the "
        "value's name, payload length and checksum hold) and its namespace (one layout digest); "
        "report per namespace. Safe while engines use the tier.",
    )
    check_path.add_argument(
        "path", nargs="?", metavar="PATH|URL",
        help="the store directory (a disk tier's path:), or a server URL (valkey://HOST:PORT[/DB])",
    )
    check_path.add_argument("--fix", action="store_true", help="drop bad blocks and repair the index (valkey: DEL bad values)")
    check_path.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    check_path.add_argument(
        "--namespace", metavar="NS",
        help="valkey: check only the values NS:<key> (default: every kvtier:* namespace, i.e. every tier "
        "whose namespace was derived from its layout; name a tier's own namespace: to check it)",
    )
    check_path.add_argument(
        "--config", metavar="FILE",
        help="valkey: check the shared tier a kvtier YAML names (its url or cluster_nodes, username, "
        "password_file, tls and namespace), instead of a URL",
    )
    check_path.add_argument("--tier", metavar="NAME", help="valkey: with --config, which valkey tier (if several)")
    check_path.add_argument(
        "--layout", metavar="DIGEST",
        help="valkey: the layout digest (32 hex digits) every value of the namespace must carry; "
        "without it a namespace whose values carry several layouts is reported and none of those "
        "values is deleted, whatever their numbers (default namespaces kvtier:<digest> name theirs)",
    )
    check_path.add_argument(
        "--cluster", metavar="HOST:PORT,...",
        help="valkey: a cluster, instead of a URL: some of its nodes (the rest are discovered)",
    )
    check_path.add_argument(
        "--secret-file", metavar="FILE",
        help="the tier's secret_file: verify keyed blocks/values (without it, a store of keyed blocks "
        "reports them as problems and --fix is refused; keyed values on a server are counted unverified)",
    )
    check_path.set_defaults(func=_check)

    soak = commands.add_parser(
        "soak",
        help="mixed load over a CPU + disk stack, with faults injected on a schedule (exit 1 on a wrong or lost block)",
        description="Run an engine-like load over a real CPU + disk stack for --minutes, verifying every "
        "block served; with --faults, kill a writer, fill the filesystem (root), corrupt blocks and share "
        "the store with a second process, in turn. Prints counts and one JSON line.",
    )
    soak.add_argument("--minutes", type=float, default=1.0, help="how long to run (default 1; fractions allowed)")
    soak.add_argument("--faults", action="store_true", help="inject faults on a schedule")
    soak.add_argument("--kind", choices=("lmdb", "files"), default="lmdb", help="disk tier kind (default lmdb)")
    soak.add_argument("--dir", default=None, help="where the stores go (default: the temp directory)")
    soak.add_argument("--seed", type=int, default=0, help="random seed of the load and the schedule")
    soak.add_argument("--json", action="store_true", help="print only the JSON line")
    soak.set_defaults(func=_soak)

    bench = commands.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="TARGET")
    bench_manager = bench_commands.add_parser(
        "manager", help="scheduler-side cost per block of the single-tier manager, LRU and ARC "
        "(--stack: a step of the stack manager at growing CPU-tier sizes)"
    )
    bench_manager.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_manager.add_argument("--keys", type=int, default=100_000, help="distinct keys stored (default 100000)")
    bench_manager.add_argument("--capacity", type=int, default=50_000, help="tier size in blocks (default 50000)")
    bench_manager.add_argument("--runs", type=int, default=5, help="runs per figure; the median is kept (default 5)")
    bench_manager.add_argument(
        "--stack", action="store_true",
        help="the stack manager over an in-memory lower tier, per step, at each of --sizes CPU blocks",
    )
    bench_manager.add_argument(
        "--sizes", default="10000,100000,1000000", help="--stack: CPU-tier sizes in blocks (default 10^4,10^5,10^6)"
    )
    bench_manager.add_argument("--steps", type=int, default=1000, help="--stack: timed steps per run (default 1000)")
    bench_manager.set_defaults(func=_bench_manager)
    bench_transfer = bench_commands.add_parser(
        "transfer", help="GPU<->CPU handler throughput against one contiguous copy of the same bytes"
    )
    bench_transfer.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_transfer.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the KV cache lives: cuda if available (auto), or CPU tensors standing in for it",
    )
    bench_transfer.add_argument("--max-batch", type=int, default=512, help="largest batch in blocks (default 512)")
    bench_transfer.add_argument("--runs", type=int, default=5, help="runs per figure; the median is kept (default 5)")
    bench_transfer.add_argument("--layers", type=int, default=32, help="layers (canonical tensors) (default 32)")
    bench_transfer.add_argument("--no-kernel", action="store_true",
                                help="on CUDA, do not also time the kernel engine (Triton)")
    bench_transfer.set_defaults(func=_bench_transfer)
    bench_disk = bench_commands.add_parser(
        "disk", help="a disk tier's write and cold-read GB/s against raw O_DIRECT I/O of the same bytes"
    )
    bench_disk.add_argument("--backend", choices=disk_kinds, required=True, help="disk tier kind")
    bench_disk.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_disk.add_argument("--gib", type=float, default=2.0, help="GiB written and read, as 2 MiB blocks (default 2)")
    bench_disk.add_argument("--threads", type=int, default=None, help="I/O threads, tier and baseline alike (default 16)")
    bench_disk.add_argument("--dir", default=None, help="where the stores go (default /var/tmp); not a tmpfs")
    bench_disk.add_argument("--rounds", type=int, default=5, help="rounds; the median is kept (default 5)")
    bench_disk.add_argument(
        "--open-blocks", type=int, default=100_000,
        help="blocks in the store whose open is timed (open_s; default 100000, 0 skips it)",
    )
    bench_disk.add_argument(
        "--fsync", choices=FSYNC_CHOICES, default="batch",
        help="the tier's fsync policy while writing (default batch; vLLM's fs tier never flushes)",
    )
    bench_disk.add_argument(
        "--no-drop-caches", action="store_true",
        help="never empty the machine's page cache (as root it does, for cold reads and opens)",
    )
    bench_disk.add_argument(
        "--secrets", action="store_true",
        help="also measure the tier with a secret_file (keyed MAC) and with encrypt: aes-gcm, "
        "side by side; *_cost = 1 - rate / the plain tier's (needs the cryptography package)",
    )
    bench_disk.set_defaults(func=_bench_disk)
    bench_remote = bench_commands.add_parser(
        "remote", help="the valkey tier's store/load GB/s against the raw client's pipelined SET/GET"
    )
    bench_remote.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_remote.add_argument("--mib", type=int, default=128, help="MiB per block size and round (default 128)")
    bench_remote.add_argument("--rounds", type=int, default=5, help="paired rounds; the median is kept (default 5)")
    bench_remote.add_argument(
        "--url", default=None,
        help="a server of yours (default: a local valkey-server on 127.0.0.1). The bench writes only "
        "under kvtier-bench:<run id>: and DELs exactly the keys it wrote (never FLUSHDB); it refuses a "
        "database that holds keys unless --allow-nonempty. A password: KVTIER_VALKEY_PASSWORD in the "
        "environment, not in the URL",
    )
    bench_remote.add_argument(
        "--allow-nonempty", action="store_true",
        help="run against a --url database that already holds keys (they are not touched, but the "
        "bench's values may push them out under maxmemory)",
    )
    bench_remote.add_argument(
        "--secrets", action="store_true",
        help="also measure the tier with a secret_file (keyed MAC and names) and with encrypt: aes-gcm, "
        "side by side; *_cost = 1 - rate / the plain tier's (needs the cryptography package)",
    )
    bench_remote.set_defaults(func=_bench_remote)
    bench_cascade = bench_commands.add_parser(
        "cascade",
        help="a lower tier as a mirror (receives: saved) or a victim tier (receives: evicted): "
        "bytes written, hits, time, on a trace",
    )
    bench_cascade.add_argument("trace", nargs="?", default=None, metavar="TRACE",
                               help="JSONL trace (default: the bundled Mooncake trace)")
    bench_cascade.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    bench_cascade.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_cascade.set_defaults(func=_bench_cascade)
    return parser


def _add_plan(commands: Any) -> None:
    from kvtier.plan.run import DEFAULT_BLOCK_BYTES, DEFAULT_CAPACITIES

    plan = commands.add_parser(
        "plan",
        help="hit ratio against cache size per eviction policy, Belady's bound, tier sizes",
        description="Simulate a Mooncake-format trace (default: the bundled one) through one pooled "
        "cache at many sizes, bookkeeping only, with the policies the managers use; print the "
        "prefix-hit-ratio table, Belady's offline optimum and the unbounded ceiling, and the "
        "smallest CPU and disk tier sizes reaching the targets. Two bounds from the trace's future "
        "show what is left to gain: reuse_oracle (the policies told which blocks never come back) "
        "and the disk-admission table (writes an oracle could skip at no loss vs admit: reuse).",
    )
    plan.add_argument("trace", nargs="?", metavar="TRACE", help="JSONL trace (default: bundled Mooncake trace)")
    plan.add_argument("--capacities", type=int, nargs="+", default=list(DEFAULT_CAPACITIES), metavar="N",
                      help="cache sizes in blocks (default: %(default)s)")
    plan.add_argument("--policies", nargs="+", metavar="NAME", help="policies to simulate (default: all registered)")
    plan.add_argument("--target", type=float, default=0.95,
                      help="share of the ceiling the disk tier must reach (default 0.95)")
    plan.add_argument("--cpu-target", type=float, default=0.5,
                      help="share of the ceiling the CPU tier alone must reach (default 0.5)")
    plan.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES,
                      help="bytes per block, for sizes in bytes (default %(default)s: 512 tokens of Llama-3-8B fp16)")
    plan.add_argument("--plot", metavar="FILE.png", help="draw the hit-ratio curves, Belady's and the ceiling")
    plan.add_argument("--admission-policy", default="lru", metavar="NAME",
                      help="CPU tier policy of the disk-admission table (default: lru)")
    plan.add_argument("--min-reuse", type=int, default=2, metavar="N",
                      help="admit: reuse threshold compared in the disk-admission table (default: 2)")
    plan.add_argument("--signals", action="store_true",
                      help="also report P(referenced again) by what a policy knows at store time")
    plan.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                      help="simulations run side by side in N processes (default: the CPU count, "
                      "%(default)s here)")
    plan.add_argument("--json", action="store_true", help="print only the JSON line")
    plan.set_defaults(func=_plan)


class _Stopped(BaseException):
    """SIGTERM or SIGHUP arrived: unwind like an interrupt, so every ``with`` and ``finally``
    on the way out runs (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: the signals a service manager stops a process with (systemd, Docker and Kubernetes send
#: SIGTERM; a closed terminal or session sends SIGHUP)
_STOP_SIGNALS = ("SIGTERM", "SIGHUP")


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """While a command runs, SIGTERM and SIGHUP become a normal exit that cleans up.

    By default either kills the process outright: the CPU tier's region (the tier's whole
    capacity, holding users' KV data) stays in ``/dev/shm`` and ``kvtier replay``'s temporary
    store in the working directory. Here the first one raises :class:`_Stopped` in the main
    thread, which unwinds through the stack's shutdown and the temporary directories; later
    ones are ignored until that is done, so they cannot cut the clean-up short. Outside the
    main thread (signals cannot be caught there) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [getattr(signal, name) for name in _STOP_SIGNALS if hasattr(signal, name)]

    def stop(signum: int, frame: object) -> None:
        for number in numbers:
            signal.signal(number, signal.SIG_IGN)
        raise _Stopped(signum)

    previous = {number: signal.signal(number, stop) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _stop_on_signals():
            return args.func(args)
    except _Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"kvtier: stopped by {name}; temporary stores and the CPU region removed", file=sys.stderr)
        return 128 + stopped.signum  # what a shell reports for a process the signal ended


if __name__ == "__main__":
    sys.exit(main())

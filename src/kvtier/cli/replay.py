"""``kvtier replay``: a request trace through the real tier stack, every loaded block verified."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import add_trace_argument, count, disk_kinds, report, warn_password_in_url
from kvtier.codecs import CODEC_NAMES
from kvtier.cli.costing import add_cost_options, time_model
from kvtier.errors import KvtierError
from kvtier.routing import ROUTERS


def add_parser(sub: Any) -> None:
    """``kvtier replay``: its options."""
    replay = sub.add_parser(
        "replay",
        help="replay a request trace through the real tier stack, verifying every loaded block",
        description="Replay a Mooncake-format trace (default: the bundled one) through a simulated "
        "engine over the real manager, tiers and bytes; print hits per tier (with --json, one JSON line instead).",
    )
    add_trace_argument(replay)
    replay.add_argument(
        "--config",
        metavar="CFG",
        help="kvtier YAML (default: CPU + disk tier in a temp folder; never $KVTIER_CONFIG: a "
        "replay writes its blocks into the stack's stores)",
    )
    replay.add_argument(
        "--gpu-blocks", type=count(), default=2000, help="blocks in the simulated GPU cache (default 2000)"
    )
    replay.add_argument(
        "--block-bytes", type=count(), default=16 * 1024, help="payload bytes per block (default 16384)"
    )
    replay.add_argument("--limit", type=count(), help="replay only the first N requests")
    replay.add_argument(
        "--disk", choices=disk_kinds(), default="lmdb", help="disk tier kind of the default stack"
    )
    replay.add_argument(
        "--codec",
        choices=CODEC_NAMES,
        help="store blocks in every lower tier with this codec (in the bytes the stack gives it); "
        "lossy ones are verified against their own decode",
    )
    replay.add_argument("--no-baseline", action="store_true", help="skip the CPU-tier-only comparison run")
    replay.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown on stderr, on a terminal only)"
    )
    replay.add_argument(
        "--deterministic",
        action="store_true",
        help="each step waits for its copies and tier jobs: the same figures every "
        "run (the hits per tier too), a little slower",
    )
    replay.add_argument(
        "--fresh",
        action="store_true",
        help="empty the disk stores --config names before the replay (kvtier's own stores only), "
        "so that blocks of earlier runs do not count as hits",
    )
    replay.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the hit ratio per tier over time, the ceiling, and the CPU-tier-only run",
    )
    replay.add_argument("--json", action="store_true", help="print only the JSON line")
    replay.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="cpu",
        help="where the simulated GPU cache lives: CPU tensors (default), cuda, or cuda if available (auto)",
    )
    replay.add_argument(
        "--engines",
        type=count(),
        metavar="N",
        help="a fleet: N engine processes (at most 64) behind a router (--router), run with a shared "
        "valkey tier and with local disks only (--config is then each engine's local stack; "
        "--no-baseline: shared only)",
    )
    replay.add_argument(
        "--router",
        choices=ROUTERS.names(),
        default="round_robin",
        help="with --engines: where each request goes: round_robin (default), least_loaded, or prefix "
        "(the engine holding the longest prefix, fed by the engines' KV events, within a load bound)",
    )
    replay.add_argument(
        "--valkey", metavar="URL", help="the fleet's shared server (default: a local valkey-server)"
    )
    replay.add_argument(
        "--valkey-cluster", metavar="HOST:PORT,...", help="the fleet's shared cluster, instead of --valkey"
    )
    add_cost_options(replay)
    replay.add_argument(
        "--arrival-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="with --model: stretch the arrival times X-fold (a cluster's trace on one GPU; default 1)",
    )
    replay.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.replay.run import replay

    warn_password_in_url(args.valkey, "replay")
    if args.engines is None and (args.valkey or args.valkey_cluster):
        print(
            "kvtier replay: --valkey and --valkey-cluster name a fleet's shared server: add --engines N",
            file=sys.stderr,
        )
        return 2
    if args.engines is not None:
        if args.fresh:
            print(
                "kvtier replay: --fresh empties one engine's stores, not a fleet's (drop --fresh "
                "or --engines)",
                file=sys.stderr,
            )
            return 2
        if args.deterministic:
            print(
                "kvtier replay: --deterministic is for one engine; engine processes sharing a "
                "server interleave as the OS schedules them (drop --engines or --deterministic)",
                file=sys.stderr,
            )
            return 2
        if args.device != "cpu":
            print(
                "kvtier replay: --engines runs each engine's cache as CPU tensors (the fleet "
                "measures the shared tier, not the GPU copies); drop --device or --engines",
                file=sys.stderr,
            )
            return 2
        return _run_fleet(args)
    if args.router != "round_robin":
        print("kvtier replay: --router routes a fleet's requests: add --engines N", file=sys.stderr)
        return 2
    try:
        priced = _priced(args)
        record = report(
            args,
            lambda out: replay(
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
                time_model=priced,
                arrival_scale=args.arrival_scale,
                codec=args.codec,
                fresh=args.fresh,
            ),
        )  # the JSON line only with --json (printed by report): a person gets the table
    except KvtierError as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    # Wrong bytes served is the one outcome a replay must never show; corrupt blocks found
    # (and dropped) by a tier are a counted miss, not a failure.
    return 1 if record["mismatched_blocks"] else 0


def _priced(args: argparse.Namespace) -> Any:
    """The time model of ``--model``/``--gpu``/... (None without ``--model``), its
    ``--arrival-scale`` checked."""
    priced = time_model(args)
    if not args.arrival_scale > 0:
        raise KvtierError(f"--arrival-scale must be positive (got {args.arrival_scale})")
    if priced is None and args.arrival_scale != 1.0:
        raise KvtierError("--arrival-scale stretches the time model's arrivals: add --model NAME")
    return priced


def _run_fleet(args: argparse.Namespace) -> int:
    from kvtier.replay.fleet import replay_fleet

    nodes = [node.strip() for node in args.valkey_cluster.split(",")] if args.valkey_cluster else None
    try:
        priced = _priced(args)
        record = report(
            args,
            lambda out: replay_fleet(
                args.trace,
                args.config,
                engines=args.engines,
                valkey_url=args.valkey,
                cluster_nodes=nodes,
                gpu_blocks=args.gpu_blocks,
                block_bytes=args.block_bytes,
                limit=args.limit,
                router=args.router,
                baseline=not args.no_baseline,
                time_model=priced,
                arrival_scale=args.arrival_scale,
                out=out,
                progress=not args.no_progress,
            ),
        )  # the JSON line only with --json (printed by report)
    except (KvtierError, OSError, ImportError) as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    return 1 if record["mismatched_blocks"] else 0

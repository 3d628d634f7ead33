"""``kvtier plan``: hit ratio against cache size per eviction policy, Belady's bound, tier sizes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvtier.cli.common import add_trace_argument, count, report
from kvtier.codecs import CODEC_NAMES
from kvtier.cli.costing import add_cost_options, time_model
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier plan``: its options."""
    from kvtier.plan.run import DEFAULT_CAPACITIES

    plan = sub.add_parser(
        "plan",
        help="hit ratio against cache size per eviction policy, Belady's bound, tier sizes",
        description="Simulate a Mooncake-format trace (default: the bundled one) through one pooled "
        "cache at many sizes, bookkeeping only, with the policies the managers use; print the "
        "prefix-hit-ratio table, Belady's offline optimum and the unbounded ceiling, and the "
        "smallest CPU and disk tier sizes reaching the targets. Two bounds from the trace's future "
        "show what is left to gain: reuse_oracle (the policies told which blocks never come back) "
        "and the disk-admission table (writes an oracle could skip at no loss vs admit: reuse). "
        "--write-config turns the advice into a kvtier YAML stack.",
    )
    add_trace_argument(plan)
    plan.add_argument(
        "--capacities",
        type=count(),
        nargs="+",
        default=list(DEFAULT_CAPACITIES),
        metavar="N",
        help="cache sizes in blocks (default: %(default)s)",
    )
    plan.add_argument(
        "--policies", nargs="+", metavar="NAME", help="policies to simulate (default: all registered)"
    )
    plan.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="share of the ceiling the disk tier must reach (default 0.95)",
    )
    plan.add_argument(
        "--cpu-target",
        type=float,
        default=0.5,
        help="share of the ceiling the CPU tier alone must reach (default 0.5)",
    )
    plan.add_argument(
        "--block-bytes",
        type=count(),
        help="bytes per block, for sizes in bytes (default: --model's KV of a 512-token trace block, "
        "else 64 MiB: 512 tokens of Llama-3-8B fp16)",
    )
    plan.add_argument(
        "--write-config",
        metavar="FILE",
        help="write the advised CPU + disk stack to FILE as kvtier YAML (capacities in the bytes each "
        "tier counts per block, a disk tier's header included; check it with kvtier config check FILE)",
    )
    plan.add_argument(
        "--plot", metavar="FILE.png", help="draw the hit-ratio curves, Belady's and the ceiling"
    )
    plan.add_argument(
        "--admission-policy",
        default="lru",
        metavar="NAME",
        help="CPU tier policy of the disk-admission table (default: lru)",
    )
    plan.add_argument(
        "--min-reuse",
        type=int,
        default=2,
        metavar="N",
        help="admit: reuse threshold compared in the disk-admission table (default: 2)",
    )
    plan.add_argument(
        "--signals",
        action="store_true",
        help="also report P(referenced again) by what a policy knows at store time",
    )
    plan.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="simulations run side by side in N processes (default: the CPU count, %(default)s here)",
    )
    add_cost_options(plan)
    plan.add_argument(
        "--prices",
        metavar="FILE",
        help="with --model: GPU-seconds saved per dollar of each DRAM/NVMe/shared tier size "
        "combination (YAML/JSON prices; see examples/costs/prices.yaml)",
    )
    plan.add_argument(
        "--cost-target",
        type=float,
        default=0.9,
        help="with --prices: recommend the cheapest stack saving this share of the best (default 0.9)",
    )
    plan.add_argument(
        "--gpu-blocks",
        type=count(),
        default=2000,
        help="with --prices: blocks of the GPU prefix cache (default 2000)",
    )
    plan.add_argument("--money-plot", metavar="FILE.png", help="with --prices: draw saving against cost")
    plan.add_argument(
        "--codec",
        choices=CODEC_NAMES,
        help="also show, at each size's bytes, the blocks a disk tier holds with this codec (bf16 KV) "
        "and the hit ratio they reach",
    )
    plan.add_argument(
        "--no-progress", action="store_true", help="no progress bar (stderr, on a terminal only)"
    )
    plan.add_argument("--json", action="store_true", help="print only the JSON line")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.plan.run import plan

    try:
        priced = time_model(args)
        report(
            args,
            lambda out: plan(
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
                prices=args.prices,
                time_model=priced,
                cost_target=args.cost_target,
                gpu_blocks=args.gpu_blocks,
                money_plot=args.money_plot,
                codec=args.codec,
                progress=not args.no_progress,
                write_config=args.write_config,
            ),
        )
    except KvtierError as exc:
        print(f"kvtier plan: {exc}", file=sys.stderr)
        return 2
    return 0

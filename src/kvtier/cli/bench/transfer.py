"""``kvtier bench transfer``: GPU<->CPU handler throughput against one contiguous copy."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.cli.common import report


def add_parser(sub: Any) -> None:
    """``kvtier bench transfer``: its options."""
    bench_transfer = sub.add_parser(
        "transfer", help="GPU<->CPU handler throughput against one contiguous copy of the same bytes"
    )
    bench_transfer.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_transfer.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the KV cache lives: cuda if available (auto), or CPU tensors standing in for it",
    )
    bench_transfer.add_argument(
        "--max-batch", type=int, default=512, help="largest batch in blocks (default 512)"
    )
    bench_transfer.add_argument(
        "--runs", type=int, default=5, help="runs per figure; the median is kept (default 5)"
    )
    bench_transfer.add_argument(
        "--layers", type=int, default=32, help="layers (canonical tensors) (default 32)"
    )
    bench_transfer.add_argument(
        "--no-kernel", action="store_true", help="on CUDA, do not also time the kernel engine (Triton)"
    )
    bench_transfer.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import transfer

    record = report(
        args,
        lambda out: transfer.run(
            device=args.device,
            max_batch=args.max_batch,
            runs=args.runs,
            layers=args.layers,
            out=out,
            kernel=not args.no_kernel,
        ),
    )
    return 0 if record["rows"] and record["verified"] else 1

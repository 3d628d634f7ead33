"""``kvtier bench codec``: each codec's ratio and encode/decode GB/s per core, against memcpy."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import report
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier bench codec``: its options."""
    from kvtier.bench.codec import BLOCK_SIZES
    from kvtier.codecs import CODEC_NAMES

    bench_codec = sub.add_parser(
        "codec",
        help="each lower-tier codec's ratio and encode/decode GB/s on one core, against memcpy",
        description="Encode and decode KV blocks with each codec (none = memcpy, the baseline) on one "
        "core: ratio, GB/s, and for lossy codecs the RMS error; synthetic bf16 KV without a model.",
    )
    bench_codec.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_codec.add_argument(
        "--codecs",
        nargs="+",
        default=list(CODEC_NAMES),
        choices=CODEC_NAMES,
        help="codecs to measure (default: all; none, the baseline, always runs)",
    )
    bench_codec.add_argument(
        "--block-bytes",
        type=int,
        nargs="+",
        default=list(BLOCK_SIZES),
        help="block sizes, bytes (default 64 KiB, 512 KiB, 2 MiB: how cost grows with size)",
    )
    bench_codec.add_argument("--mib", type=int, default=32, help="MiB of blocks per size (default 32)")
    bench_codec.add_argument("--rounds", type=int, default=5, help="rounds; medians are kept (default 5)")
    bench_codec.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="element dtype of the synthetic KV (default bfloat16)",
    )
    bench_codec.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import codec

    try:
        report(
            args,
            lambda out: codec.run(
                codecs=args.codecs,
                block_sizes=args.block_bytes,
                mib=args.mib,
                rounds=args.rounds,
                dtype=args.dtype,
                out=out,
            ),
        )  # the JSON line only with --json (printed by report): a person gets the table
    except KvtierError as exc:
        print(f"kvtier bench codec: {exc}", file=sys.stderr)
        return 2
    return 0

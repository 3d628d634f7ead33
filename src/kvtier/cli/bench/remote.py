"""``kvtier bench remote``: the valkey tier's store/load GB/s against the raw client."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.common import add_secrets_option, report, warn_password_in_url
from kvtier.codecs import CODEC_NAMES
from kvtier.errors import KvtierError


def add_parser(sub: Any) -> None:
    """``kvtier bench remote``: its options."""
    bench_remote = sub.add_parser(
        "remote", help="the valkey tier's store/load GB/s against the raw client's pipelined SET/GET"
    )
    bench_remote.add_argument("--json", action="store_true", help="print only the JSON line")
    bench_remote.add_argument(
        "--mib", type=int, default=128, help="MiB per block size and round (default 128)"
    )
    bench_remote.add_argument(
        "--rounds", type=int, default=5, help="paired rounds; the median is kept (default 5)"
    )
    bench_remote.add_argument(
        "--url",
        default=None,
        help="a server of yours (default: a local valkey-server on 127.0.0.1). The bench writes only "
        "under kvtier-bench:<run id>: and DELs exactly the keys it wrote (never FLUSHDB); it refuses a "
        "database that holds keys unless --allow-nonempty. A password: KVTIER_VALKEY_PASSWORD in the "
        "environment, not in the URL",
    )
    bench_remote.add_argument(
        "--allow-nonempty",
        action="store_true",
        help="run against a --url database that already holds keys (they are not touched, but the "
        "bench's values may push them out under maxmemory)",
    )
    add_secrets_option(bench_remote, keyed="keyed MAC and names")
    bench_remote.add_argument(
        "--codec",
        action="append",
        default=[],
        choices=[name for name in CODEC_NAMES if name != "none"],
        help="also measure the tier storing values with this codec (repeatable), on synthetic bf16 "
        "KV: its GB/s, the bytes it sent and the server memory its values took",
    )
    bench_remote.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import remote

    warn_password_in_url(args.url, "bench remote")
    try:
        report(
            args,
            lambda out: remote.run(
                mib=args.mib,
                rounds=args.rounds,
                url=args.url,
                out=out,
                allow_nonempty=args.allow_nonempty,
                secrets=args.secrets,
                codecs=args.codec,
            ),
        )
    except (KvtierError, RuntimeError, OSError, ImportError) as exc:
        # no server binary or client, or a block that failed or came back different
        print(f"kvtier bench remote: {exc}", file=sys.stderr)
        return 1
    return 0

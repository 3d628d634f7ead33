"""``kvtier stats``: a running engine's counters, from its metrics endpoint (a port or its Unix
socket) or stats file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvtier.errors import KvtierError

#: seconds between two refreshes of --watch without a number
DEFAULT_WATCH_S = 2.0
#: the longest --watch interval (a day)
MAX_WATCH_S = 86400.0
#: ANSI: cursor home, clear the screen (what `watch` does)
_CLEAR = "\x1b[H\x1b[2J"


def add_parser(sub: Any) -> None:
    """``kvtier stats``: its options."""
    parser = sub.add_parser(
        "stats",
        help="a running engine's tier table and misses by cause, from its metrics endpoint or stats file",
        description="Read a running kvtier's counters and print the tier table (blocks, hits, bytes "
        "moved, failures, evictions, job latencies) and the misses by cause. SOURCE is the engine's "
        "metrics endpoint (http://127.0.0.1:9400/metrics, or 127.0.0.1:9400: its config's "
        "metrics.port; or the path of its metrics.unix_socket) or the file its config's "
        "metrics.stats_file names. The hit ratio counts kvtier's tiers only: hits / (hits + "
        "misses) of the blocks asked for after a GPU miss (a replay's counts the GPU's hits "
        "too, over every block of the trace). An endpoint "
        "must answer in 5 s, without a redirect. Exit 2 if SOURCE cannot be read or holds anything "
        "kvtier would not write.",
    )
    parser.add_argument(
        "source",
        metavar="URL|PATH",
        help="http://HOST:PORT/metrics (or HOST:PORT), a metrics Unix socket, or a stats file",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}, at most {MAX_WATCH_S:g}) until Ctrl-C",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.set_defaults(func=run)


def _show(source: str, as_json: bool, clear: bool) -> None:
    from kvtier.metrics.view import read_series, render, summarize

    summary = summarize(read_series(source))
    if as_json:
        print(json.dumps(summary, sort_keys=True), flush=True)
        return
    text = render(summary)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print((_CLEAR if clear else "") + f"kvtier stats  {source}  {stamp}\n\n" + text, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.watch is not None and not 0 < args.watch <= MAX_WATCH_S:
        print(
            f"kvtier stats: --watch takes seconds > 0 and <= {MAX_WATCH_S:g} (got {args.watch:g})",
            file=sys.stderr,
        )
        return 2
    try:
        _show(args.source, args.json, clear=args.watch is not None and not args.json)
        while args.watch is not None:
            time.sleep(args.watch)
            _show(args.source, args.json, clear=not args.json)
    except KvtierError as exc:
        print(f"kvtier stats: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how --watch ends
    return 0

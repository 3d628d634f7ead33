"""``admit: budget`` at half the unthrottled write rate, against ``admit: all`` (the baseline,
same run) and ``min_reuse: 2``, over the bundled trace replayed in its own time.

    python benchmarks/bench_write_budget.py [TRACE] [--limit N] [--fraction 0.5] [--window-s 300]

Prints a table (bytes written and hit ratio of each run), then one JSON line; see
``kvtier.bench.write_budget`` for the runs and docs/results.md for the figures.
"""

import argparse
import sys

from kvtier.bench.report import print_json
from kvtier.bench.write_budget import compare_write_budget

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="Mooncake JSONL trace (default: the bundled one)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--fraction", type=float, default=0.5, help="budget / unthrottled rate")
    parser.add_argument("--window-s", type=float, default=300.0, help="budget_window_s of the runs")
    args = parser.parse_args()
    record = compare_write_budget(
        args.trace, limit=args.limit, fraction=args.fraction, window_s=args.window_s, out=sys.stdout
    )
    print_json(record, sys.stdout)

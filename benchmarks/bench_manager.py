"""Scheduler-side cost per block of kvtier's single-tier manager, against vLLM's CPU manager.

    python benchmarks/bench_manager.py [--json] [--keys 100000] [--capacity 50000] [--runs 5]

The same as ``kvtier bench manager``; see ``kvtier.bench.manager`` for the protocol.
Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "manager", *sys.argv[1:]]))

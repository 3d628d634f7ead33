"""A lower tier as a mirror (``receives: saved``) or a victim tier (``receives: evicted``):
bytes written, hits and time over a trace, the mirror as the baseline of the same run.

    python benchmarks/bench_cascade.py [TRACE] [--limit N] [--json]

The same as ``kvtier bench cascade``; see ``kvtier.bench.cascade`` for the protocol.
Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "cascade", *sys.argv[1:]], table_and_json=True))

"""GPU<->CPU handler throughput against one contiguous copy of the same bytes, measured in the same run.

    python benchmarks/bench_transfer.py [--json] [--device auto|cpu|cuda] [--max-batch 512] [--runs 5] [--layers 32]

The same as ``kvtier bench transfer``; see ``kvtier.bench.transfer`` for the protocol.
Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transfer", *sys.argv[1:]], table_and_json=True))

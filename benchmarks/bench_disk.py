"""A disk tier's write and cold-read rates against raw O_DIRECT I/O of the same bytes.

    python benchmarks/bench_disk.py --backend lmdb|files [--json] [--gib 2] [--threads 16]
                                    [--dir /var/tmp] [--rounds 5] [--fsync batch]

The same as ``kvtier bench disk``; see ``kvtier.bench.disk`` for the protocol.
Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "disk", *sys.argv[1:]], table_and_json=True))

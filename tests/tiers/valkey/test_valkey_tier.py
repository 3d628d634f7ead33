"""The valkey tier against a real server: bytes, verification, namespaces, the lookup protocol,
and a server that dies, hangs or comes back empty."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from kvtier_testing.valkey_tier import BLOCK_BYTES, SETTLE_S, finish, open_tier, settle
from kvtier_testing import key, payload

from kvtier.tiers.base import Failure, FailureKind, TierJob
from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint


def fill(rows, keys):
    for index, k in enumerate(keys):
        rows[index] = payload(k, rows.shape[1])


def store(tier, keys, rows, job_id=1):
    fill(rows, keys)
    tier.submit_store(TierJob(job_id, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    return result


def load(tier, keys, job_id=2):
    tier.submit_load(TierJob(job_id, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    return result


def test_bytes_round_trip_through_a_second_tier(valkey_server):
    keys = [key(i) for i in range(8)]
    rows_a = np.zeros((8, BLOCK_BYTES), dtype=np.uint8)
    writer = open_tier(valkey_server.url, rows_a)
    reader_rows = np.zeros((8, BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_server.url, reader_rows)
    try:
        result = store(writer, keys, rows_a)
        assert result.success and sorted(result.ok) == sorted(keys)
        assert [writer.lookup(k) for k in keys] == [True] * 8  # it stored them: known at once

        # The other tier knows nothing: None, then the step's batch of reads answers.
        assert [reader.lookup(k) for k in keys] == [None] * 8
        assert settle(reader, keys) == [True] * 8
        assert reader.stats()["probe_batches"] == 1
        hits_before = valkey_server.client().info("stats")["keyspace_hits"]
        result = load(reader, keys)
        assert result.success and sorted(result.ok) == sorted(keys)
        for index, k in enumerate(keys):
            assert np.array_equal(reader_rows[index], payload(k, BLOCK_BYTES))
        # the load used the values the reads brought: no second GET
        assert valkey_server.client().info("stats")["keyspace_hits"] == hits_before
        assert reader.stats()["staged_blocks"] == 0 and reader.stats()["loaded_blocks"] == 8
        events = writer.take_events()
        assert [e.removed for e in events] == [False] and sorted(events[0].keys) == sorted(keys)
    finally:
        writer.close()
        reader.close()


def test_a_missing_key_is_asked_once_then_remembered(valkey_server):
    tier = open_tier(valkey_server.url, miss_ttl_s=600)
    try:
        absent = [key(100 + i) for i in range(5)]
        assert settle(tier, absent) == [False] * 5
        batches = tier.stats()["probe_batches"]
        for _ in range(3):  # more lookups and steps within miss_ttl_s: no new reads
            assert [tier.lookup(k) for k in absent] == [False] * 5
            tier.on_schedule_end()
        assert tier.stats()["probe_batches"] == batches == 1
        assert tier.stats()["probe_misses"] == 5
    finally:
        tier.close()


def test_a_key_found_missing_is_asked_again_after_miss_ttl(valkey_server):
    tier = open_tier(valkey_server.url, miss_ttl_s=0.05)
    try:
        k = key(1)
        assert settle(tier, [k]) == [False]
        time.sleep(0.1)
        assert tier.lookup(k) is None  # forgotten: asked again
        assert settle(tier, [k]) == [False]
        assert tier.stats()["probe_batches"] == 2
    finally:
        tier.close()


def raw_name(tier, k) -> bytes:
    return (tier.namespace + ":" + k.hex()).encode()


def test_altered_truncated_and_misplaced_values_are_counted_misses(valkey_server):
    keys = [key(i) for i in range(4)]
    rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    writer = open_tier(valkey_server.url, rows)
    raw = valkey_server.client()
    try:
        assert store(writer, keys, rows).success
        values = [raw.get(raw_name(writer, k)) for k in keys]
        assert all(len(v) == HEADER_BYTES + BLOCK_BYTES for v in values)
        altered = bytearray(values[0])
        altered[HEADER_BYTES + 1000] ^= 0xFF
        raw.set(raw_name(writer, keys[0]), bytes(altered))  # a flipped payload byte
        raw.set(raw_name(writer, keys[1]), values[1][: HEADER_BYTES + 100])  # truncated
        raw.set(raw_name(writer, keys[2]), values[3])  # another key's value
        raw.set(raw_name(writer, keys[3]), b"not a block at all")
    finally:
        writer.close()

    reader_rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_server.url, reader_rows)
    try:
        # The header checks run on the read: only the flipped payload byte passes them.
        assert settle(reader, keys) == [True, False, False, False]
        assert reader.stats()["corrupt_values"] == 3
        result = load(reader, keys[:1])
        assert not result.success and result.failed[keys[0]] == Failure.corrupt("checksum")
        assert reader.stats()["corrupt_values"] == 4
        assert reader.lookup(keys[0]) is False  # a corrupt value is remembered as a miss
        assert not reader_rows[1:].any()  # nothing was written where nothing was served
    finally:
        reader.close()


def test_another_layout_is_never_served(valkey_server):
    keys = [key(i) for i in range(3)]
    rows = np.zeros((3, BLOCK_BYTES), dtype=np.uint8)
    other = LayoutFingerprint("other-model", "bfloat16", 16, (BLOCK_BYTES,), 0, 1, BLOCK_BYTES)
    # forced into one namespace, as a misconfigured fleet would be: the header still refuses
    writer = open_tier(valkey_server.url, rows, other, namespace="shared-ns")
    reader = open_tier(valkey_server.url, namespace="shared-ns")
    try:
        assert store(writer, keys, rows).success
        assert settle(reader, keys) == [False] * 3
        assert reader.stats()["corrupt_values"] == 3
    finally:
        writer.close()
        reader.close()


def test_another_namespace_is_never_read(valkey_server):
    keys = [key(i) for i in range(3)]
    rows = np.zeros((3, BLOCK_BYTES), dtype=np.uint8)
    writer = open_tier(valkey_server.url, rows, namespace="model-a")
    reader = open_tier(valkey_server.url, namespace="model-b")
    raw = valkey_server.client()
    try:
        assert store(writer, keys, rows).success
        hits_before = raw.info("stats")["keyspace_hits"]
        assert settle(reader, keys) == [False] * 3
        # its reads asked for model-b names only, which the server does not have: no hit at all
        assert raw.info("stats")["keyspace_hits"] == hits_before
        assert reader.stats()["corrupt_values"] == 0
        assert sorted(raw.keys("*")) == sorted(raw_name(writer, k) for k in keys)
    finally:
        writer.close()
        reader.close()


def test_the_default_namespace_follows_the_layout(valkey_server):
    a = open_tier(valkey_server.url, fingerprint=LayoutFingerprint.standalone(BLOCK_BYTES))
    other = LayoutFingerprint("m", "fp8", 16, (BLOCK_BYTES,), 0, 1, BLOCK_BYTES)
    b = open_tier(valkey_server.url, fingerprint=other)
    try:
        assert a.namespace.startswith("kvtier:") and a.namespace != b.namespace
    finally:
        a.close()
        b.close()


def wait_until(predicate, what):
    deadline = time.monotonic() + SETTLE_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_killed_server_fails_jobs_then_the_tier_reconnects_to_an_empty_one(valkey_server, caplog):
    rows = np.zeros((16, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows)
    try:
        first = [key(i) for i in range(8)]
        assert store(tier, first, rows).success
        valkey_server.kill()  # mid-run: the next jobs find no server
        later = [key(100 + i) for i in range(16)]
        fill(rows, later)
        tier.submit_store(TierJob(2, tuple(later), tuple(range(16))))
        tier.submit_load(TierJob(3, (first[0],), (0,)))  # known present, but nobody answers
        results = {r.job_id: r for r in finish(tier)}
        assert not results[2].success and {r.kind for r in results[2].failed.values()} == {
            FailureKind.UNAVAILABLE
        }
        assert not results[3].success
        assert tier.down and tier.stats()["outages"] == 1 and tier.stats()["down"] == 1
        assert sum("unreachable" in r.message for r in caplog.records) == 1
        # While down: answers at once, no waiting on the network.
        assert [tier.lookup(k) for k in first] == [False] * 8
        tier.submit_store(TierJob(4, (later[0],), (0,)))
        assert [{k: r.kind for k, r in j.failed.items()} for j in finish(tier)] == [
            {later[0]: FailureKind.UNAVAILABLE}
        ]
        for _ in range(3):
            tier.on_schedule_end()  # reconnect attempts fail quietly
        assert sum("unreachable" in r.message for r in caplog.records) == 1

        valkey_server.start()  # back, and empty

        def reconnected():
            tier.on_schedule_end()
            return not tier.down

        wait_until(reconnected, "the tier never reconnected")
        assert tier.stats()["outage_ms"] > 0 and tier.stats()["outages"] == 1
        # What it stored before is gone: asked again, and a miss.
        assert settle(tier, first) == [False] * 8
        assert store(tier, later[:4], rows, job_id=5).success
    finally:
        tier.close()


def test_a_hung_server_fails_jobs_after_timeout_s(valkey_server):
    rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows, timeout_s=0.3)
    keys = [key(i) for i in range(4)]
    os.kill(valkey_server.pid, signal.SIGSTOP)
    try:
        tier.submit_store(TierJob(1, tuple(keys), (0, 1, 2, 3)))
        assert tier.lookup(key(50)) is None
        tier.on_schedule_end()  # a read for key(50) goes out, and hangs too
        (result,) = finish(tier)
        assert set(result.failed.values()) == {Failure(FailureKind.UNAVAILABLE, detail="timeout")}
        assert tier.stats()["failed_unavailable_timeout"] >= 4  # and the read, unless it expired first
        assert tier.down
        assert settle(tier, [key(50)]) == [False]
    finally:
        os.kill(valkey_server.pid, signal.SIGCONT)
    try:

        def reconnected():
            tier.on_schedule_end()
            return not tier.down

        wait_until(reconnected, "the tier never reconnected")
        assert store(tier, keys, rows, job_id=2).success
    finally:
        tier.close()


def test_ttl_and_check(valkey_server):
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows, ttl_s=60)
    raw = valkey_server.client()
    try:
        keys = [key(1), key(2)]
        assert store(tier, keys, rows).success
        assert 0 < raw.pttl(raw_name(tier, keys[0])) <= 60_000
        assert tier.check().healthy and tier.check().blocks_checked == 2
        raw.set(raw_name(tier, keys[1]), b"garbage")
        report = tier.check(fix=True)
        assert len(report.problems) == 1 and len(report.fixed) == 1
        assert raw.exists(raw_name(tier, keys[1])) == 0
    finally:
        tier.close()


@pytest.mark.parametrize("unreachable", ["valkey://127.0.0.1:1/0"])
def test_an_unreachable_server_at_open_is_an_outage_not_an_error(server_binary, unreachable):
    tier = open_tier(unreachable)
    try:
        assert tier.down
        assert tier.lookup(key(1)) is False
    finally:
        tier.close()


def test_wait_loads_returns_while_a_store_waits_on_paused_writes(valkey_server):
    """A reader waits for its loads only: the server pauses writes (CLIENT PAUSE WRITE, reads
    still served), a store is stuck behind it, a load of stored keys completes meanwhile."""
    rows = np.zeros((16, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows, timeout_s=30.0)
    admin = valkey_server.client()
    try:
        stored = [key(i) for i in range(4)]
        assert store(tier, stored, rows).success
        admin.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
        try:
            later = [key(i) for i in range(10, 14)]
            for index, k in enumerate(later):
                rows[8 + index] = payload(k, BLOCK_BYTES)
            tier.submit_store(TierJob(5, tuple(later), tuple(range(8, 12))))
            rows[:4] = 0
            tier.submit_load(TierJob(6, tuple(stored), (0, 1, 2, 3)))
            tier.wait_loads()
            results = {result.job_id: result for result in tier.get_finished_jobs()}
            assert 5 not in results and tier.has_pending_work()  # the store is still waiting
            assert sorted(results[6].ok) == sorted(stored)
            assert all(np.array_equal(rows[i], payload(k, BLOCK_BYTES)) for i, k in enumerate(stored))
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        (result,) = finish(tier)
        assert result.job_id == 5 and sorted(result.ok) == sorted(later)
    finally:
        tier.close()


# -- values of the wrong length are never held (issue #22, item 6) ------------------------------

#: a value planted under a tier's name, far longer than any of its values
PLANTED_BYTES = 40 << 20


@pytest.fixture
def roomy_server(server_binary):
    """A server with room for a planted value (the shared fixture's has 64 MiB)."""
    from kvtier.tiers.valkey.server import LocalValkeyServer

    with LocalValkeyServer(server_binary, maxmemory=512 << 20) as server:
        yield server


def held_at_peak(action) -> int:
    """The most bytes Python and numpy held at once (tracemalloc) while ``action`` ran."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        action()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_planted_long_value_is_read_off_and_dropped_by_a_probe(roomy_server):
    valkey_server = roomy_server
    tier = open_tier(valkey_server.url)
    try:
        planted, honest = key(1), key(2)
        raw = valkey_server.client()
        raw.set(tier._name(planted), b"\0" * PLANTED_BYTES)
        rows = np.zeros((1, BLOCK_BYTES), dtype=np.uint8)
        writer = open_tier(valkey_server.url, rows)
        assert store(writer, [honest], rows).success
        writer.close()
        answers: list = []
        peak = held_at_peak(lambda: answers.extend(settle(tier, [planted, honest])))
        assert answers == [False, True]
        assert tier.stats()["corrupt_values"] == 1 and tier.stats()["corrupt_payload_length"] == 1
        assert peak < PLANTED_BYTES // 4, peak  # the read buffer and one batch, not the value
        assert tier.stats()["staged_bytes"] <= tier.config.max_inflight_bytes
    finally:
        tier.close()


def test_a_planted_long_value_fails_a_load_without_being_held(roomy_server):
    valkey_server = roomy_server
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows)
    try:
        keys = [key(1), key(2)]
        assert store(tier, keys, rows).success  # known present: the load reads without a probe
        valkey_server.client().set(tier._name(keys[0]), b"\1" * PLANTED_BYTES)
        rows[:] = 0
        results: list = []
        peak = held_at_peak(lambda: results.append(load(tier, keys)))
        (result,) = results
        assert result.ok == [keys[1]] and np.array_equal(rows[1], payload(keys[1], BLOCK_BYTES))
        assert result.failed == {keys[0]: Failure.corrupt("payload length")}
        assert not rows[0].any()  # nothing of it reached the row
        assert peak < PLANTED_BYTES // 4, peak
        assert tier.lookup(keys[0]) is False  # remembered as gone
    finally:
        tier.close()


def test_a_probe_with_few_hits_keeps_only_their_values(valkey_server):
    """A batch's values share one array; held slices of it would keep the whole batch."""
    import tracemalloc

    value_bytes = HEADER_BYTES + BLOCK_BYTES
    rows = np.zeros((1, BLOCK_BYTES), dtype=np.uint8)
    writer = open_tier(valkey_server.url, rows)
    assert store(writer, [key(0)], rows).success
    writer.close()
    tier = open_tier(valkey_server.url, max_inflight_bytes=32 * value_bytes)
    try:
        keys = [key(i) for i in range(32)]  # one batch, one hit
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        assert settle(tier, keys) == [True] + [False] * 31
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert tier.stats()["staged_blocks"] == 1
        assert held < 8 * value_bytes, held  # the hit, not the 32-value batch
    finally:
        tier.close()

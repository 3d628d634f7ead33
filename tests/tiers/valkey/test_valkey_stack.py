"""The valkey tier under the stack manager: engines sharing blocks, an engine that outlives its
server, and a cluster that loses a node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvtier_testing.valkey_tier import BLOCK_BYTES, SETTLE_S, finish, open_tier, settle
from kvtier_testing import key, payload, read_blocks, store_blocks

import kvtier
from kvtier import ReqContext
from kvtier.tiers.base import TierJob

ENGINE = Path(__file__).with_name("engine_process.py")


def run_engine(role: str, url: str, first: int, count: int) -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, str(ENGINE), role, url, str(first), str(count)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_engine_processes_share_blocks(valkey_server):
    stored = run_engine("store", valkey_server.url, 0, 12)
    loaded = run_engine("load", valkey_server.url, 0, 12)
    assert stored["pid"] != loaded["pid"]
    assert loaded["hits"] == 12 and loaded["verified"] == 12 and "mismatched" not in loaded
    assert loaded["promotions"] == 12
    # blocks the first engine never stored are misses for the second
    assert run_engine("load", valkey_server.url, 100, 4)["hits"] == 0


def stack(url, cpu_blocks=16, **options):
    config = {
        "tiers": [
            {
                "name": "cpu",
                "kind": "cpu",
                "capacity": cpu_blocks * (BLOCK_BYTES + 4096),
                "pin_memory": "off",
            },
            {"name": "shared", "kind": "valkey", "url": url, "timeout_s": 0.5, **options},
        ],
        "cascade": {"write_policy": "write_through"},
    }
    return kvtier.build_manager(config, block_bytes=BLOCK_BYTES)


def steps(manager, count=5):
    for _ in range(count):
        manager.on_schedule_end()
        time.sleep(0.005)


def test_the_engine_goes_on_when_the_server_dies(valkey_server):
    manager = stack(valkey_server.url)
    ctx = ReqContext("r")
    try:
        first = [key(i) for i in range(4)]
        store_blocks(manager, first, ctx)
        manager.on_schedule_end()  # write-through: saved below
        valkey_server.kill()
        second = [key(10 + i) for i in range(4)]
        store_blocks(manager, second, ctx)
        deadline = time.monotonic() + SETTLE_S
        while manager.has_pending_work() and time.monotonic() < deadline:
            steps(manager, 1)
        figures = manager.stats()
        assert figures["shared.down"] == 1 and figures["shared.demote_failures"] >= 4
        # The CPU tier still serves, and what is only on the dead server is a plain miss.
        assert all(manager.lookup(k, ctx) is True for k in first + second)
        assert manager.lookup(key(99), ctx) is False
        for k, got in zip(first, read_blocks(manager, first, ctx)):
            assert np.array_equal(got, payload(k, BLOCK_BYTES))
    finally:
        manager.shutdown()  # the flush fails fast against the dead server: no hang


def test_a_promotion_from_the_shared_tier_moves_real_bytes(valkey_server):
    writer = stack(valkey_server.url)
    ctx = ReqContext("w")
    keys = [key(i) for i in range(6)]
    store_blocks(writer, keys, ctx)
    writer.shutdown()
    reader = stack(valkey_server.url)
    try:
        ctx = ReqContext("r")
        deadline = time.monotonic() + SETTLE_S
        while True:
            answers = [reader.lookup(k, ctx) for k in keys]
            if all(a is True for a in answers) or time.monotonic() > deadline:
                break
            steps(reader, 1)
        assert answers == [True] * 6
        for k, got in zip(keys, read_blocks(reader, keys, ctx)):
            assert np.array_equal(got, payload(k, BLOCK_BYTES))
        assert reader.stats()["shared.promotions"] == 6
    finally:
        reader.shutdown()


def node_of(cluster, name: bytes) -> int:
    """Index of the cluster node serving ``name``'s slot."""
    from valkey.cluster import key_slot

    slot, count = key_slot(name), len(cluster.servers)
    # LocalValkeyCluster gives node i the slots from i * 16384 // count on
    return max(i for i in range(count) if i * 16384 // count <= slot)


def test_a_cluster_spreads_keys_and_survives_a_dead_node(valkey_cluster):
    count = 24
    rows = np.zeros((count, BLOCK_BYTES), dtype=np.uint8)
    keys = [key(i) for i in range(count)]
    writer = open_tier(valkey_cluster.nodes, rows)
    try:
        for index, k in enumerate(keys):
            rows[index] = payload(k, BLOCK_BYTES)
        writer.submit_store(TierJob(1, tuple(keys), tuple(range(count))))
        (result,) = finish(writer)
        assert result.success
        sizes = [server.client().dbsize() for server in valkey_cluster.servers]
        assert sum(sizes) == count and all(size > 0 for size in sizes)  # on all three nodes
        names = {k: (writer.namespace + ":" + k.hex()).encode() for k in keys}
    finally:
        writer.close()

    dead = 1
    valkey_cluster.servers[dead].kill()
    alive = [k for k in keys if node_of(valkey_cluster, names[k]) != dead]
    lost = [k for k in keys if node_of(valkey_cluster, names[k]) == dead]
    assert alive and lost

    reader_rows = np.zeros((count, BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_cluster.nodes, reader_rows)
    try:
        answers = dict(zip(keys, settle(reader, keys)))
        assert all(answers[k] is True for k in alive)
        assert all(answers[k] is False for k in lost)
        assert not reader.down  # one node down is not an outage of the tier
        reader.submit_load(TierJob(2, tuple(alive), tuple(range(len(alive)))))
        (result,) = finish(reader)
        assert result.success
        for index, k in enumerate(alive):
            assert np.array_equal(reader_rows[index], payload(k, BLOCK_BYTES))
    finally:
        reader.close()


# -- failed promotions: typed reasons through the stack (issue #21) ------------------------------


def on_server_only(url, keys, **options):
    """A cpu -> valkey stack with 6 CPU rows that stored ``keys`` (write-through, two at a
    time) and evicted the first four from its CPU tier: those are on the server only."""
    manager = stack(url, cpu_blocks=6, namespace="ns", **options)
    ctx = ReqContext("w")
    for at in range(0, len(keys), 2):
        store_blocks(manager, keys[at : at + 2], ctx)
        steps(manager, 1)  # write-through: the blocks go down at the step's end
        deadline = time.monotonic() + SETTLE_S
        while manager.has_pending_work() and time.monotonic() < deadline:
            steps(manager, 1)
    assert manager.stats()["shared.demotions"] == len(keys)
    return manager


def promote(manager, keys, ctx) -> list[bool | None]:
    """Look ``keys`` up, stepping, until none answers None (at most SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        answers = [manager.lookup(k, ctx) for k in keys]
        if None not in answers or time.monotonic() > deadline:
            return answers
        steps(manager, 1)


def raw_name(k) -> bytes:
    return b"ns:" + k.hex().encode()


def test_a_value_altered_by_a_raw_set_fails_its_promotion_counted_corrupt(valkey_server):
    keys = [key(i) for i in range(12)]
    manager = on_server_only(valkey_server.url, keys)
    raw = valkey_server.client()
    try:
        altered = keys[:2]
        for k in altered:
            value = bytearray(raw.get(raw_name(k)))
            value[-1] ^= 0xFF  # header intact, payload altered: only the checksum can tell
            raw.set(raw_name(k), bytes(value))
        ctx = ReqContext("r")
        answers = promote(manager, keys[:4], ctx)  # no AttributeError from the scheduler side
        assert answers[:2] == [False, False] and answers[2:] == [True, True]
        figures = manager.stats()
        assert figures["shared.promote_failures"] == 2 and figures["shared.corrupt_blocks"] == 2
        assert figures["shared.corrupt_values"] == 2 and figures["shared.corrupt_checksum"] == 2
        for k, got in zip(keys[2:4], read_blocks(manager, keys[2:4], ctx)):
            assert np.array_equal(got, payload(k, BLOCK_BYTES))
        steps(manager, 2)
        assert [manager.lookup(k, ctx) for k in altered] == [False, False]  # never served
    finally:
        manager.shutdown()


def test_a_value_the_server_dropped_fails_its_promotion_counted_missing(valkey_server):
    keys = [key(i) for i in range(12)]
    manager = on_server_only(valkey_server.url, keys)
    raw = valkey_server.client()
    try:
        raw.delete(raw_name(keys[0]))  # as allkeys-lru would
        ctx = ReqContext("r")
        assert promote(manager, keys[:2], ctx) == [False, True]
        figures = manager.stats()
        assert figures["shared.promote_failures"] == 1 and figures["shared.corrupt_blocks"] == 0
        assert figures["shared.failed_missing"] == 1
        raw.flushall()
        assert promote(manager, keys[2:4], ctx) == [False, False]
        assert manager.stats()["shared.failed_missing"] == 3
    finally:
        manager.shutdown()


def test_a_stopped_server_fails_promotions_without_an_exception(valkey_server):
    keys = [key(i) for i in range(12)]
    manager = on_server_only(valkey_server.url, keys)
    try:
        valkey_server.kill()
        ctx = ReqContext("r")
        assert promote(manager, keys[:4], ctx) == [False] * 4
        figures = manager.stats()
        assert figures["shared.promote_failures"] == 4 and figures["shared.corrupt_blocks"] == 0
        assert (
            figures["shared.failed_unavailable_refused"] + figures.get("shared.failed_unavailable_closed", 0)
            == 4
        )
        assert figures["shared.down"] == 1
    finally:
        manager.shutdown()


def test_a_paused_server_times_promotions_out_without_an_exception(valkey_server):
    keys = [key(i) for i in range(12)]
    manager = on_server_only(valkey_server.url, keys, timeout_s=0.3)
    os.kill(valkey_server.pid, signal.SIGSTOP)
    try:
        ctx = ReqContext("r")
        assert promote(manager, keys[:4], ctx) == [False] * 4
        figures = manager.stats()
        assert figures["shared.promote_failures"] == 4
        assert figures["shared.failed_unavailable_timeout"] == 4 and figures["shared.down"] == 1
    finally:
        os.kill(valkey_server.pid, signal.SIGCONT)
        manager.shutdown()


def test_a_warm_replay_after_raw_sets_serves_no_wrong_byte(valkey_server, tmp_path, capsys):
    from kvtier.cli.main import main

    config = tmp_path / "stack.yaml"
    config.write_text(
        "block_size_tokens: 512\n"
        "tiers:\n"
        "  - {name: cpu, kind: cpu, capacity: 8MiB, pin_memory: 'off'}\n"
        f"  - {{name: shared, kind: valkey, url: '{valkey_server.url}', namespace: rp, timeout_s: 2}}\n"
    )
    replay = ["replay", "--config", str(config), "--limit", "40", "--no-progress", "--json", "--no-baseline"]
    assert main(replay) == 0
    cold = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    raw = valkey_server.client()
    names = list(raw.scan_iter(match=b"rp:*"))
    assert len(names) == cold["stored_blocks"] > 0
    for name in names:  # another client rewrites every value: header intact, payload altered
        value = bytearray(raw.get(name))
        value[-1] ^= 0x5A
        raw.set(name, bytes(value))
    assert main(replay) == 0
    warm = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert warm["mismatched_blocks"] == 0 and warm["hits"].get("shared", 0) == 0
    assert warm["corrupt_blocks"] > 0 and warm["verified_blocks"] == 0

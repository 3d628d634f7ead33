"""Engines that disagree on a layout, a TP size or a namespace miss each other's blocks: the
shared tier's sibling probe says so (``foreign_<part>``), where otherwise all is ``new``."""

from __future__ import annotations

import time

import pytest
from kvtier_testing import key, store_blocks
from kvtier_testing.valkey_tier import BLOCK_BYTES, SETTLE_S

import kvtier
from kvtier import ReqContext
from kvtier.manager.causes import CAUSES
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.tiers.valkey.siblings import KEYS_PER_STEP, differing_part

OWN = LayoutFingerprint.standalone(BLOCK_BYTES)


def layout(**changes) -> LayoutFingerprint:
    return LayoutFingerprint(**{**OWN.to_dict(), **changes})


def stack(url, fingerprint=OWN, **options):
    config = {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 16 * (BLOCK_BYTES + 4096), "pin_memory": "off"},
            {"name": "shared", "kind": "valkey", "url": url, "timeout_s": 2.0, **options},
        ],
        "cascade": {"write_policy": "write_through"},
    }
    return kvtier.build_manager(config, block_bytes=BLOCK_BYTES, fingerprint=fingerprint)


def settle(manager, keys, ctx):
    """Each key's answer, looked up alone, stepping while None."""
    answers = []
    for k in keys:
        deadline = time.monotonic() + SETTLE_S
        while (answer := manager.lookup(k, ctx)) is None:
            assert time.monotonic() < deadline
            manager.on_schedule_end()
            manager.tiers[0].drain_jobs()
        answers.append(answer)
    return answers


def probe_until_done(manager):
    """Steps until the tier probed every key it was asked to (never a timing assertion)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        manager.on_schedule_end()
        manager.tiers[0].drain_jobs()
        manager.on_schedule_end()  # folds what the probe found
        stats = manager.stats()
        if stats["shared.sibling_probed_keys"] >= stats["misses"]:
            return stats
        assert time.monotonic() < deadline, stats


@pytest.mark.parametrize(
    ("other", "options", "part"),
    [
        (layout(world_size=2, rank=1), {}, "tp"),
        (layout(model="another-model"), {}, "layout"),
        (OWN, {"namespace": "team-b"}, "namespace"),
    ],
    ids=["tp", "layout", "namespace"],
)
def test_a_block_stored_by_a_disagreeing_engine_is_foreign(valkey_server, other, options, part):
    blocks = [key(i) for i in range(KEYS_PER_STEP + 2)]  # more than one step's probe
    writer = stack(valkey_server.url)
    ctx = ReqContext("r")
    try:
        # an engine looks its blocks up before it computes them: new misses, probed, and
        # with its first probe the tier publishes its layout
        assert settle(writer, blocks, ctx) == [False] * len(blocks)
        store_blocks(writer, blocks, ctx)
        writer.on_schedule_end()
        writer.flush()
        assert writer.stats()["miss_new"] == len(blocks)
    finally:
        writer.shutdown()
    reader = stack(valkey_server.url, other, **options)
    try:
        assert settle(reader, blocks, ctx) == [False] * len(blocks)
        stats = probe_until_done(reader)
        assert stats["misses"] == len(blocks)
        assert {c: stats[f"miss_{c}"] for c in CAUSES if stats[f"miss_{c}"]} == {"foreign": len(blocks)}
        assert stats[f"foreign_{part}"] == len(blocks) and stats["shared.miss_foreign"] == len(blocks)
        fresh = [key(1000)]  # never stored by anyone: new, and stays new after its probe
        assert settle(reader, fresh, ctx) == [False]
        stats = probe_until_done(reader)
        assert stats["miss_new"] == 1 and stats["miss_foreign"] == len(blocks)
        assert settle(reader, blocks[:1], ctx) == [False]  # known foreign now: at once
        assert reader.stats()["miss_foreign"] == len(blocks) + 1
    finally:
        reader.shutdown()


def test_a_tier_with_a_secret_neither_publishes_nor_probes(valkey_server, tmp_path):
    pytest.importorskip("cryptography")
    import os

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    manager = stack(valkey_server.url, secret_file=str(secret))
    try:
        assert settle(manager, [key(1)], ReqContext("r")) == [False]
        manager.on_schedule_end()
        stats = manager.stats()
        assert "shared.sibling_probed_keys" not in stats and stats["miss_new"] == 1
        assert not valkey_server.client().exists(b"kvtier-layouts")
    finally:
        manager.shutdown()


def test_which_part_differs():
    own = OWN.to_dict()
    assert differing_part(own, dict(own)) == "namespace"
    assert differing_part(own, {**own, "world_size": 4, "rank": 2}) == "tp"
    assert differing_part(own, {**own, "dtype": "fp8", "world_size": 4}) == "layout"

"""The SecondaryTier contract, for both disk tiers (and the in-memory double where it applies)."""

import logging
import os
import random
from collections import OrderedDict

import numpy as np
import pytest
from kvtier_testing import key
from kvtier_testing.store import (
    BLOCK,
    KINDS,
    fill,
    fingerprint,
    holds,
    load,
    open_tier,
    region,
    store,
)

from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.errors import ConfigError
from kvtier.policies.arc import ARCPolicy
from kvtier.tiers.disk import check_store, get_store_class, open_store
from kvtier.tiers.disk import store as disk_module
from kvtier.tiers.base import Failure, TierJob
from kvtier.errors import DiskTierError
from kvtier.testing import MemoryTier
from kvtier.tiers.disk.blockio import ODirectProbe, probe_o_direct


def make(kind, path, rows, blocks, **options):
    if kind == "memory":
        return MemoryTier("disk", rows, blocks)
    return open_tier(kind, path, rows, blocks, **options)


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_round_trip_byte_for_byte(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 16)
    keys = [key(i) for i in range(8)]
    assert store(tier, shm.rows, keys).ok == keys
    result = load(tier, shm.rows, keys, first_row=32)
    assert result.success and result.ok == keys and result.nbytes == 8 * BLOCK
    assert all(holds(shm.rows, 32 + i, k) for i, k in enumerate(keys))
    tier.close()


@pytest.mark.parametrize("o_direct", ["on", "off"])
@pytest.mark.parametrize("block_bytes", [BLOCK, 8192])
def test_round_trip_with_and_without_o_direct(kind, tmp_path, o_direct, block_bytes):
    if o_direct == "on" and not probe_o_direct(str(tmp_path)).supported:
        pytest.skip("no O_DIRECT on this filesystem")
    shm = region(16, block_bytes)
    try:
        tier = open_tier(kind, tmp_path / "s", shm.rows, 8, o_direct=o_direct)
        assert tier.o_direct is (o_direct == "on")
        keys = [key(i) for i in range(6)]
        assert store(tier, shm.rows, keys).success
        assert load(tier, shm.rows, keys, first_row=8).success
        assert all(holds(shm.rows, 8 + i, k) for i, k in enumerate(keys))
        assert tier.stats()["o_direct_fallbacks"] == 0
        tier.close()
    finally:
        shm.close()


def test_rows_that_cannot_take_o_direct_fall_back_logged_and_counted(kind, tmp_path, caplog):
    rows = np.zeros((8, BLOCK), dtype=np.uint8)  # plain memory: no page alignment, no padding
    with caplog.at_level(logging.WARNING):
        tier = open_tier(kind, tmp_path / "s", rows, 4, o_direct="auto")
    assert not tier.o_direct and tier.stats()["o_direct_fallbacks"] == 1
    assert "O_DIRECT not used" in caplog.text and tier.o_direct_fallback_reason
    keys = [key(i) for i in range(3)]
    assert store(tier, rows, keys).success
    assert load(tier, rows, keys, first_row=4).success
    assert all(holds(rows, 4 + i, k) for i, k in enumerate(keys))
    tier.close()
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.o_direct"):
        open_tier(kind, tmp_path / "s", rows, 4, o_direct="on")


def test_o_direct_on_where_the_probe_fails_is_an_open_error(kind, tmp_path, shm, monkeypatch):
    monkeypatch.setattr(disk_module, "probe_o_direct", lambda d: ODirectProbe(False, "EINVAL here"))
    with pytest.raises(ConfigError, match=r"o_direct.*EINVAL here"):
        open_tier(kind, tmp_path / "s", shm.rows, 4, o_direct="on")
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4, o_direct="auto")
    assert not tier.o_direct and tier.stats()["o_direct_fallbacks"] == 1
    tier.close()


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_lookup_is_none_until_the_store_is_polled(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 8)
    k = key(1)
    assert tier.lookup(k) is False
    tier.submit_store(TierJob(7, (k,), (0,)))
    assert tier.lookup(k) is None and tier.has_pending_work()
    tier.drain_jobs()
    assert tier.lookup(k) is None  # finished, but not handed over yet
    (result,) = tier.get_finished_jobs()
    assert result.job_id == 7 and result.ok == [k]
    assert tier.lookup(k) is True and not tier.has_pending_work()
    tier.close()


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_wait_loads_hands_over_the_loads_with_stores_beside_them(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 16)
    old = [key(i) for i in range(4)]
    new = [key(i) for i in range(10, 14)]
    assert store(tier, shm.rows, old).ok == old
    for row, k in enumerate(new, start=8):
        fill(shm.rows, row, k)
    shm.rows[32:36] = 0
    tier.submit_store(TierJob(20, tuple(new), tuple(range(8, 12))))
    tier.submit_load(TierJob(21, tuple(old), tuple(range(32, 36))))
    tier.wait_loads()
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert results[21].ok == old  # the load finished, whatever the store is doing
    assert all(holds(shm.rows, 32 + i, k) for i, k in enumerate(old))
    if 20 not in results:
        tier.drain_jobs()
        (late,) = tier.get_finished_jobs()
        results[20] = late
    assert results[20].ok == new
    assert load(tier, shm.rows, new, first_row=40).ok == new
    assert all(holds(shm.rows, 40 + i, k) for i, k in enumerate(new))
    tier.close()


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_store_skips_present_keys(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 8)
    a, b = key(1), key(2)
    store(tier, shm.rows, [a])
    tier.take_events()
    result = store(tier, shm.rows, [a, b])
    assert sorted(result.ok) == sorted([a, b]) and tier.num_blocks() == 2
    (event,) = tier.take_events()
    assert event.keys == [b] and not event.removed and event.medium == tier.medium
    assert event.block_size == BLOCK
    tier.close()


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_eviction_is_lru_and_spares_keys_being_read(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 4)
    keys = [key(i) for i in range(6)]
    for i in range(4):
        store(tier, shm.rows, [keys[i]], first_row=i)
    tier.touch([keys[0]])  # LRU order now 1, 2, 3, 0
    tier.take_events()
    shm.rows[40] = 0
    tier.submit_load(TierJob(100, (keys[1],), (40,)))  # 1 is being read: never a victim
    others: list = []
    result = store(tier, shm.rows, keys[4:6], first_row=4, others=others)
    assert result.ok == keys[4:6]
    removed = [k for e in tier.take_events() if e.removed for k in e.keys]
    assert removed == [keys[2], keys[3]]
    assert [tier.lookup(k) for k in keys] == [True, True, False, False, True, True]
    tier.drain_jobs()
    (loaded,) = others + tier.get_finished_jobs()
    assert loaded.job_id == 100 and loaded.ok == [keys[1]] and holds(shm.rows, 40, keys[1])
    assert tier.stats()["evicted"] == 2
    tier.close()


@pytest.mark.parametrize("any_kind", [*KINDS, "memory"])
def test_full_when_nothing_may_be_evicted(any_kind, tmp_path, shm):
    tier = make(any_kind, tmp_path / "s", shm.rows, 2)
    a, b, c = key(1), key(2), key(3)
    store(tier, shm.rows, [a, b])
    tier.submit_load(TierJob(50, (a, b), (10, 11)))
    others: list = []
    result = store(tier, shm.rows, [c], first_row=2, others=others)
    assert result.failed == {c: Failure.FULL} and tier.lookup(c) is False
    tier.drain_jobs()
    assert [r.ok for r in others + tier.get_finished_jobs()] == [[a, b]]
    tier.close()


def _on_disk(tier) -> int:
    """Blocks the medium holds, counted on disk (not from the tier's own view)."""
    if tier.kind == "lmdb":
        with tier._env.begin() as txn:
            return txn.stat(tier._blocks)["entries"]
    return sum(len([n for n in os.listdir(tier._shown(d)) if n.endswith(".kvb")]) for d in tier._subdirs)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_random_workload_never_exceeds_capacity_and_evicts_per_policy(kind, policy, tmp_path, shm):
    capacity = 6
    tier = open_tier(kind, tmp_path / "s", shm.rows, capacity, eviction=policy)
    rng = random.Random(7)
    universe = [key(i) for i in range(20)]
    model_lru: OrderedDict = OrderedDict()
    model_arc = ARCPolicy(capacity)
    for step in range(120):
        action = rng.random()
        if action < 0.5:
            batch = rng.sample(universe, rng.randint(1, 4))
            new = [k for k in batch if k not in model_lru]
            need = len(model_lru) + len(new) - capacity
            expected_victims = []
            if need > 0:
                if policy == "lru":
                    expected_victims = [k for k in model_lru if k not in batch][:need]
                else:
                    expected_victims = [k for k, _ in model_arc.evict(need, set(batch))]
            tier.take_events()
            result = store(tier, shm.rows, batch)
            assert result.success, result.failed
            removed = [k for e in tier.take_events() if e.removed for k in e.keys]
            assert removed == expected_victims, f"step {step}"
            for k in expected_victims:
                model_lru.pop(k)
            for k in new:
                model_lru[k] = True
            # a job's keys are coldest first; the tier hands them to its policy reversed
            # (a policy makes the first key of a call the newest)
            model_arc.insert(new[::-1], [0] * len(new))
        elif action < 0.8 and model_lru:
            batch = rng.sample(list(model_lru), min(len(model_lru), rng.randint(1, 3)))
            result = load(tier, shm.rows, batch, first_row=40)
            assert result.ok == batch
            assert all(holds(shm.rows, 40 + i, k) for i, k in enumerate(batch))
        elif model_lru:
            batch = rng.sample(list(model_lru), 1)
            tier.touch(batch)
            model_lru.move_to_end(batch[0])
            model_arc.touch(batch)
        assert tier.num_blocks() == len(model_lru) <= capacity
        assert _on_disk(tier) <= capacity
        assert {k for k in universe if tier.lookup(k)} == set(model_lru)
    tier.close()


def test_restart_serves_every_block_and_keeps_recency(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4)
    keys = [key(i) for i in range(5)]
    for i in range(4):
        store(tier, shm.rows, [keys[i]], first_row=i)  # one job each: distinct stamps
    tier.touch([keys[0], keys[1]])  # order now 2, 3, then 0 and 1
    tier.close()
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4)
    assert tier.num_blocks() == 4
    result = load(tier, shm.rows, keys[:4], first_row=20)
    assert result.ok == keys[:4]
    assert all(holds(shm.rows, 20 + i, k) for i, k in enumerate(keys[:4]))
    tier.take_events()
    store(tier, shm.rows, [keys[4]], first_row=4)
    removed = [k for e in tier.take_events() if e.removed for k in e.keys]
    assert removed == [keys[2]]
    tier.close()


def test_another_layout_serves_nothing_and_says_so(kind, tmp_path, shm, caplog):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, fp=fingerprint(model="model-a"))
    keys = [key(i) for i in range(3)]
    store(tier, shm.rows, keys)
    tier.close()
    with caplog.at_level(logging.WARNING):
        tier = open_tier(kind, tmp_path / "s", shm.rows, 8, fp=fingerprint(model="model-b"))
    assert "model=model-a" in caplog.text and "model=model-b" in caplog.text
    assert tier.num_blocks() == 0 and not any(tier.lookup(k) for k in keys)
    assert load(tier, shm.rows, keys, first_row=10).failed == {k: Failure.MISSING for k in keys}
    assert tier.check().healthy
    tier.close()
    # and the old blocks are gone from the disk, not just hidden
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, fp=fingerprint(model="model-a"))
    assert tier.num_blocks() == 0
    tier.close()


def test_reopening_with_a_smaller_capacity_keeps_it(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(8)]
    store(tier, shm.rows, keys)
    tier.close()
    tier = open_tier(kind, tmp_path / "s", shm.rows, 3)
    assert tier.num_blocks() <= 3 and _on_disk(tier) <= 3
    kept = [k for k in keys if tier.lookup(k)]
    assert load(tier, shm.rows, kept, first_row=20).ok == kept
    assert tier.check().healthy
    tier.close()


def test_open_errors_name_the_field_and_the_fix(kind, tmp_path, shm):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*create .* first"):
        open_tier(kind, tmp_path / "no" / "such" / "dir", shm.rows, 4)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*is a file"):
        open_tier(kind, tmp_path / "afile", shm.rows, 4)
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt.*never deletes"):
        open_tier(kind, user_dir, shm.rows, 4)
    assert (user_dir / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity.*at least one block"):
        open_store(
            DiskTierConfig(name="d", kind=kind, capacity_bytes=4096, path=str(tmp_path / "c")),
            shm.rows,
            fingerprint(),
        )
    # larger than the disk: opens, warned and counted (test_store_failures.py), not an error
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    huge = open_tier(kind, tmp_path / "huge", shm.rows, 2 * free // (16 << 10))
    assert huge.stats()["short_bytes"] > 0
    huge.close()
    other = "files" if kind == "lmdb" else "lmdb"
    open_tier(other, tmp_path / "other", shm.rows, 4).close()
    with pytest.raises(ConfigError, match=rf"tiers\[1\]\.kind.*holds a {other} store"):
        open_tier(kind, tmp_path / "other", shm.rows, 4)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_directory_is_an_open_error(kind, tmp_path, shm):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*may not write"):
            open_tier(kind, locked, shm.rows, 4)
    finally:
        locked.chmod(0o755)


def test_one_path_opens_once_per_process(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4)
    with pytest.raises(DiskTierError, match="already open"):
        open_tier(kind, tmp_path / "s", shm.rows, 4)
    tier.close()
    tier.close()  # idempotent
    with open_tier(kind, tmp_path / "s", shm.rows, 4) as again:
        assert again.num_blocks() == 0


def test_unknown_keys_and_too_long_keys(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4)
    assert load(tier, shm.rows, [key(99)], first_row=10).failed == {key(99): Failure.MISSING}
    too_long = b"x" * (tier.max_key_bytes + 1)
    assert store(tier, shm.rows, [too_long]).failed == {too_long: Failure.KEY_TOO_LONG}
    assert tier.stats()["failed_key_too_long"] == 1
    tier.close()


def test_registry_and_medium(kind, tmp_path, shm):
    cls = get_store_class(kind)
    assert cls.kind == kind
    with pytest.raises(ConfigError, match="lmdb, files"):
        get_store_class("tape")
    tier = open_tier(kind, tmp_path / "s", shm.rows, 4)
    assert type(tier) is cls and tier.medium == {"lmdb": "LMDB", "files": "FILES"}[kind]
    tier.close()
    assert check_store(str(tmp_path / "s")).healthy


def test_o_direct_refused_at_run_time_falls_back_once(kind, tmp_path, shm, monkeypatch, caplog):
    if not probe_o_direct(str(tmp_path)).supported:
        pytest.skip("no O_DIRECT on this filesystem")
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, o_direct="auto")
    assert tier.o_direct
    real = os.pwritev
    refused = []

    def first_refused(*args):
        if not refused:
            refused.append(args)
            raise OSError(22, "Invalid argument")  # EINVAL: what O_DIRECT misalignment gives
        return real(*args)

    monkeypatch.setattr(os, "pwritev", first_refused)
    keys = [key(i) for i in range(4)]
    with caplog.at_level(logging.WARNING):
        assert store(tier, shm.rows, keys).success
    monkeypatch.undo()
    assert not tier.o_direct and tier.stats()["o_direct_fallbacks"] == 1
    assert "an O_DIRECT write failed" in tier.o_direct_fallback_reason
    assert caplog.text.count("O_DIRECT not used") == 1
    assert load(tier, shm.rows, keys, first_row=20).success
    assert all(holds(shm.rows, 20 + i, k) for i, k in enumerate(keys))
    assert tier.check().healthy
    tier.close()


def test_io_threads_come_from_the_tier_section(kind, tmp_path, shm):
    from kvtier_testing.store import config

    cfg = config(kind, tmp_path / "s", 16, shm.rows.shape[1], threads=3)
    tier = open_store(cfg, shm.rows, fingerprint(shm.rows.shape[1]))
    try:
        assert tier._threads == 3
        keys = [key(i) for i in range(6)]
        assert store(tier, shm.rows, keys).ok == keys
        result = load(tier, shm.rows, keys, first_row=32)
        assert result.ok == keys and all(holds(shm.rows, 32 + i, k) for i, k in enumerate(keys))
    finally:
        tier.close()

"""The cascade: per lower tier, ``receives: saved`` (a mirror of every block saved out of the
CPU tier) or ``receives: evicted`` (a victim tier: only blocks the CPU tier lets go that no
saved tier above it keeps). Bytes that reach a tier are compared with the block's own."""

import numpy as np
import pytest

from kvtier_testing import key, payload, read_blocks, store_blocks
from kvtier import build_manager, load_config
from kvtier.base import ReqContext
from kvtier.config import CascadeConfig, describe
from kvtier.errors import ConfigError
from kvtier.manager.stack import TierStackManager
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend, MemoryTier

CTX = ReqContext("r")
BLOCK = 64


def make(receives, cpu_blocks=4, lower_blocks=(32, 32), write_policy="write_back", admission=None):
    backend = MemoryBackend(cpu_blocks, BLOCK)
    tiers = [MemoryTier(f"t{i}", backend.rows, n) for i, n in enumerate(lower_blocks)]
    manager = TierStackManager(
        backend,
        LRUPolicy(cpu_blocks),
        tiers,
        CascadeConfig(write_policy=write_policy),
        receives=receives,
        admission=admission,
    )
    return manager, tiers


def settle(manager):
    """Three steps: a block no saved tier keeps takes one to reach the saved tiers, one to be
    found unkept and spilled, one for the victim tier's answer."""
    for _ in range(3):
        manager.on_schedule_end()


def held_bytes(tier, k):
    return np.frombuffer(tier._blocks[k][0], dtype=np.uint8)


def assert_holds_own_bytes(tier, keys):
    for k in keys:
        assert tier.lookup(k) is True, f"{tier.name} lacks a block it should hold"
        np.testing.assert_array_equal(held_bytes(tier, k), payload(k, BLOCK))


def evicted_from_cpu(manager):
    return {
        k
        for event in manager.take_events()
        if event.medium == "MEMORY" and event.removed and not event.metadata_only
        for k in event.keys
    }


def test_saved_tiers_mirror_every_block():
    manager, (nvme, shared) = make(["saved", "saved"], cpu_blocks=8, write_policy="write_through")
    keys = [key(i) for i in range(6)]
    store_blocks(manager, keys, CTX)
    settle(manager)
    assert_holds_own_bytes(nvme, keys)
    assert_holds_own_bytes(shared, keys)
    assert manager.stats()["dirty_blocks"] == 0


def test_an_evicted_tier_gets_nothing_while_the_cpu_tier_has_room():
    # write_through moves blocks to saved tiers at once, but never to a victim tier
    manager, (victim,) = make(["evicted"], cpu_blocks=8, lower_blocks=(32,), write_policy="write_through")
    store_blocks(manager, [key(i) for i in range(5)], CTX)  # 3 free of 8: above the headroom
    for _ in range(3):
        settle(manager)
    assert victim.num_blocks() == 0
    assert manager.stats()["spill_blocks"] == 5
    assert manager.stats()["dirty_blocks"] == 5


def test_an_evicted_tier_gets_exactly_what_the_cpu_tier_lets_go():
    manager, (victim,) = make(["evicted"], cpu_blocks=4, lower_blocks=(64,))
    evicted: set = set()
    stored = []
    for i in range(20):
        stored.append(key(i))
        store_blocks(manager, [key(i)], CTX)
        settle(manager)
        evicted |= evicted_from_cpu(manager)
        in_victim = {k for k in stored if victim.lookup(k) is True}
        # every block the CPU tier dropped went to the victim tier first ...
        assert evicted <= in_victim
        # ... and the victim tier got nothing else but the few written ahead of need,
        # which are still in the CPU tier (clean)
        ahead = in_victim - evicted
        assert all(manager.lookup(k, CTX) is True for k in ahead)
        assert len(ahead) <= 1  # the clean headroom of a 4-block CPU tier
    assert len(evicted) == 16
    assert_holds_own_bytes(victim, evicted)
    assert manager.stats()["t0.demotions"] == len(evicted) + len(ahead)


def test_the_coldest_block_is_spilled_first():
    manager, (victim,) = make(["evicted"], cpu_blocks=4, lower_blocks=(64,))
    for i in range(4):
        store_blocks(manager, [key(i)], CTX)
    manager.touch([key(0)], CTX)  # key 1 is now the coldest
    settle(manager)
    assert {k for k in map(key, range(4)) if victim.lookup(k)} == {key(1)}


def test_an_evicted_tier_never_gets_a_block_a_saved_tier_above_keeps():
    manager, (nvme, victim) = make(["saved", "evicted"], cpu_blocks=4, lower_blocks=(64, 64))
    keys = [key(i) for i in range(12)]
    for i, k in enumerate(keys):
        if i in (5, 9):
            nvme.fail_next(1, "ENOSPC")  # the next nvme job refuses its block
        store_blocks(manager, [k], CTX)
        settle(manager)
    manager.flush()  # the rest leaves the CPU tier too
    refused = set(nvme.refused_keys)
    assert refused  # the failures hit
    in_nvme = {k for k in keys if nvme.lookup(k) is True}
    in_victim = {k for k in keys if victim.lookup(k) is True}
    assert in_nvme | in_victim == set(keys)
    assert not in_nvme & in_victim
    assert in_victim == refused
    assert_holds_own_bytes(nvme, in_nvme)
    assert_holds_own_bytes(victim, in_victim)


def test_a_block_no_saved_tier_admits_goes_to_the_victim_tier():
    # nvme admits only blocks wanted twice: one-off blocks go to the victim tier instead
    # wide enough that no one-off key's estimate reaches 2 through collisions: the sketch
    # hashes with Python's per-process hash, and at 64 counters a row some seeds collided
    reuse = AdmissionFilter("reuse", min_reuse=2, sketch_width=1 << 12)
    manager, (nvme, victim) = make(
        ["saved", "evicted"], cpu_blocks=4, lower_blocks=(64, 64), admission=[reuse, None]
    )
    keys = [key(i) for i in range(10)]
    for k in keys:
        store_blocks(manager, [k], CTX)
        settle(manager)
    manager.flush()
    assert nvme.num_blocks() == 0
    assert_holds_own_bytes(victim, keys)


def test_a_saved_tier_below_a_victim_tier_does_not_spare_it():
    # "above" counts: a victim tier first, then a mirror, gets what the CPU tier evicts
    manager, (victim, shared) = make(["evicted", "saved"], cpu_blocks=4, lower_blocks=(64, 64))
    keys = [key(i) for i in range(10)]
    evicted = set()
    for k in keys:
        store_blocks(manager, [k], CTX)
        settle(manager)
        evicted |= evicted_from_cpu(manager)
    assert evicted
    assert_holds_own_bytes(victim, evicted)
    manager.flush()
    assert_holds_own_bytes(shared, keys)


def test_a_block_stays_until_its_victim_save_ends():
    manager, (victim,) = make(["evicted"], cpu_blocks=4, lower_blocks=(64,))
    victim.paused = True  # victim-tier jobs stay in flight
    keys = [key(i) for i in range(4)]
    store_blocks(manager, keys, CTX)
    for _ in range(3):
        settle(manager)
    assert manager.stats()["demoting_blocks"] >= 1
    # no free row and nothing clean: a store must wait, never drop a block being spilled
    assert manager.prepare_store([key(9)], CTX) is None
    assert evicted_from_cpu(manager) == set()
    assert all(manager.lookup(k, CTX) is True for k in keys)
    victim.paused = False
    settle(manager)
    store_blocks(manager, [key(9)], CTX)
    gone = evicted_from_cpu(manager)
    assert gone == {key(3)}  # the tail of the stored prefix: the coldest
    assert_holds_own_bytes(victim, gone)
    # and it comes back up from the victim tier, byte for byte
    for _ in range(5):
        if manager.lookup(key(3), CTX) is True:
            break
        manager.on_schedule_end()
    np.testing.assert_array_equal(read_blocks(manager, [key(3)], CTX)[0], payload(key(3), BLOCK))


def test_a_failed_victim_save_lets_the_block_go():
    manager, (victim,) = make(["evicted"], cpu_blocks=4, lower_blocks=(64,))
    victim.fail_next(1, "EIO")
    store_blocks(manager, [key(i) for i in range(4)], CTX)
    settle(manager)
    assert victim.refused_keys == {key(3)}  # the tail of the prefix is spilled first
    store_blocks(manager, [key(9)], CTX)  # the refused block is the clean victim now
    assert evicted_from_cpu(manager) == {key(3)}


def test_flush_sends_waiting_blocks_to_the_victim_tier():
    manager, (nvme, victim) = make(["saved", "evicted"], cpu_blocks=8, lower_blocks=(64, 64))
    nvme.fail_next(1, "ENOSPC")
    store_blocks(manager, [key(0), key(1)], CTX)
    manager.shutdown()
    assert_holds_own_bytes(victim, [key(0), key(1)])
    assert nvme.num_blocks() == 0


def test_receives_must_name_each_lower_tier():
    backend = MemoryBackend(4, BLOCK)
    tier = MemoryTier("t", backend.rows, 4)
    with pytest.raises(ValueError, match="receives"):
        TierStackManager(backend, LRUPolicy(4), [tier], receives=["evict"])


# -- configuration ---------------------------------------------------------------------------


def stack(tmp_path, **lower):
    return {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 4 * 4096},
            {"name": "disk", "kind": "files", "path": str(tmp_path / "d"), "capacity": "1MiB", **lower},
        ]
    }


def test_receives_defaults_to_saved_and_parses_evicted(tmp_path):
    assert load_config(stack(tmp_path)).tiers[1].receives == "saved"
    config = load_config(stack(tmp_path, receives="evicted"))
    assert config.tiers[1].receives == "evicted"
    lines = describe(config).splitlines()
    assert "receives=evicted" in lines[2] and "receives" not in lines[1]  # [1] disk, [0] cpu


def test_receives_on_the_first_tier_is_an_error(tmp_path):
    config = stack(tmp_path)
    config["tiers"][0]["receives"] = "saved"
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.field == "tiers[0].receives"
    assert "tiers below" in str(info.value)


def test_a_bad_receives_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(stack(tmp_path, receives="evict"))
    assert info.value.field == "tiers[1].receives"
    assert "did you mean 'evicted'" in str(info.value)


def test_built_stack_honours_receives(tmp_path):
    manager = build_manager(stack(tmp_path, receives="evicted"), 4096)
    try:
        keys = [key(i) for i in range(2)]
        store_blocks(manager, keys, CTX)  # 2 of 4 rows: room left, nothing goes below
        settle(manager)
        assert manager.stats()["disk.blocks"] == 0
        assert manager.stats()["spill_blocks"] == 2
    finally:
        manager.shutdown()

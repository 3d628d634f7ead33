import numpy as np
import pytest

from kvtier_testing import key, payload, read_blocks, store_blocks
from kvtier.base import ReqContext
from kvtier.config import CascadeConfig
from kvtier.manager.stack import TierStackManager
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryTier
from kvtier.testing import MemoryBackend

CTX = ReqContext("r")
BLOCK = 64


def make(cpu_blocks=4, disk_blocks=8, write_policy="write_through", policy=LRUPolicy, causes=None, **cascade):
    backend = MemoryBackend(cpu_blocks, BLOCK)
    disk = MemoryTier("disk", backend.rows, disk_blocks)
    manager = TierStackManager(
        backend,
        policy(cpu_blocks),
        [disk],
        CascadeConfig(write_policy=write_policy, **cascade),
        causes=causes,
    )
    return manager, disk


def store(manager, keys):
    return store_blocks(manager, keys, CTX)


def load_bytes(manager, keys):
    return read_blocks(manager, keys, CTX)


def settle(manager):
    """Two steps: the first submits the step's jobs, the second polls their results."""
    manager.on_schedule_end()
    manager.on_schedule_end()


def resolve(manager, k, steps=5):
    """Look ``k`` up the way an engine does: step while the answer is None."""
    for _ in range(steps):
        answer = manager.lookup(k, CTX)
        if answer is not None:
            return answer
        manager.on_schedule_end()
    raise AssertionError("lookup never resolved")


def disk_bytes(disk, k):
    return np.frombuffer(disk._blocks[k][0], dtype=np.uint8)


def test_write_through_saves_every_block_below():
    manager, disk = make()
    store(manager, [key(0), key(1)])
    assert manager.stats()["dirty_blocks"] == 2
    manager.on_schedule_end()  # submits the demotion
    manager.on_schedule_end()  # polls it
    assert manager.stats()["dirty_blocks"] == 0
    for k in (key(0), key(1)):
        np.testing.assert_array_equal(disk_bytes(disk, k), payload(k, BLOCK))
    assert manager.stats()["disk.demotions"] == 2


def test_write_back_waits_for_pressure_then_saves_the_coldest():
    manager, disk = make(cpu_blocks=8, write_policy="write_back")
    store(manager, [key(i) for i in range(5)])  # 3 free + 0 clean < 25% of 8? no: 3 >= 2
    settle(manager)
    assert disk.num_blocks() == 0
    # one prefix, head first: its tail (key 4) is the coldest, its head the warmest
    manager.touch([key(4)], CTX)  # key 4 is now the warmest
    store(manager, [key(5), key(6), key(7)])  # no free rows, nothing clean: under pressure
    settle(manager)
    saved = {k for k in map(key, range(8)) if disk.lookup(k)}
    assert saved and key(4) not in saved and key(3) in saved


def test_dirty_blocks_are_never_dropped_and_stores_wait_for_clean_room():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    assert manager.prepare_store([key(2)], CTX) is None  # both dirty: nothing evictable
    settle(manager)  # saved below: now clean
    out = store(manager, [key(2)])
    assert out.evicted_keys and all(disk.lookup(k) for k in out.evicted_keys)
    assert manager.stats()["evictions"] == 1


def test_promotion_brings_a_block_up_and_serves_its_bytes():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])  # evicts keys 0 and 1 from the CPU tier
    settle(manager)  # 2 and 3 saved: clean, so a promotion can take a row
    assert manager.lookup(key(0), CTX) is None  # on disk only: read queued
    manager.on_schedule_end()  # submitted
    assert manager.lookup(key(0), CTX) is True  # polled during lookup
    np.testing.assert_array_equal(load_bytes(manager, [key(0)])[0], payload(key(0), BLOCK))
    assert manager.stats()["disk.promotions"] == 1


def test_a_key_wanted_twice_is_read_once():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])
    settle(manager)
    assert manager.lookup(key(0), ReqContext("a")) is None
    assert manager.lookup(key(0), ReqContext("b")) is None
    settle(manager)
    assert manager.lookup(key(0), CTX) is True
    stats = manager.stats()
    assert stats["disk.promote_jobs"] == 1 and stats["disk.promotions"] == 1


@pytest.mark.parametrize("fault", ["fail", "corrupt"])
def test_a_failed_or_corrupt_read_is_a_miss_and_frees_the_row(fault):
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])
    settle(manager)  # 2 and 3 saved too: clean, so a promotion can evict one
    if fault == "fail":
        disk.fail_next(1, "EIO")
    else:
        disk.corrupt(key(0))
    assert resolve(manager, key(0)) is False
    stats = manager.stats()
    assert stats["promoting_blocks"] == 0 and stats["disk.promote_failures"] == 1
    assert stats["ready_blocks"] + stats["free_blocks"] == 2  # the reserved row came back
    if fault == "corrupt":
        assert stats["disk.corrupt_blocks"] == 1 and not disk.lookup(key(0))
    assert resolve(manager, key(1)) is True
    np.testing.assert_array_equal(load_bytes(manager, [key(1)])[0], payload(key(1), BLOCK))


def test_a_refused_demotion_makes_the_block_evictable():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    disk.fail_next(1, "ENOSPC")
    settle(manager)
    stats = manager.stats()
    assert stats["disk.demote_failures"] == 2 and stats["dirty_blocks"] == 0
    out = store(manager, [key(2)])
    assert len(out.evicted_keys) == 1 and not disk.lookup(out.evicted_keys[0])


def test_promotion_budget_spreads_reads_over_steps():
    manager, disk = make(cpu_blocks=4, disk_blocks=8, max_promote_bytes_per_step=2 * BLOCK)
    store(manager, [key(i) for i in range(4)])
    settle(manager)
    store(manager, [key(i) for i in range(4, 8)])  # keys 0-3 only below now
    settle(manager)
    for i in range(3):
        assert manager.lookup(key(i), CTX) is None
    manager.on_schedule_end()
    assert manager.stats()["disk.queued_promotions"] == 1
    settle(manager)
    assert all(manager.lookup(key(i), CTX) for i in range(3))
    assert manager.stats()["disk.promote_jobs"] == 2


def test_reset_cache_forgets_the_cpu_tier_only():
    manager, disk = make()
    store(manager, [key(0)])
    manager.on_schedule_end()
    manager.reset_cache()  # the demotion in flight is waited for first
    assert manager.stats()["ready_blocks"] == 0 and disk.lookup(key(0))
    assert resolve(manager, key(0)) is True
    np.testing.assert_array_equal(load_bytes(manager, [key(0)])[0], payload(key(0), BLOCK))


def test_shutdown_saves_what_only_the_cpu_tier_holds():
    manager, disk = make(cpu_blocks=8, write_policy="write_back")
    store(manager, [key(0), key(1)])
    manager.on_schedule_end()
    assert disk.num_blocks() == 0  # no pressure: write_back has not written yet
    manager.shutdown()
    for k in (key(0), key(1)):
        np.testing.assert_array_equal(disk_bytes(disk, k), payload(k, BLOCK))
    manager.shutdown()  # idempotent


def test_a_block_already_below_is_stored_clean():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])  # 0 and 1 leave the CPU tier
    settle(manager)
    out = store(manager, [key(0)])  # recomputed by the engine, but the disk has it
    assert key(0) in out.keys_to_store
    assert key(0) not in manager._dirty


def test_events_name_their_medium():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2)])
    media = {(event.medium, event.removed) for event in manager.take_events()}
    assert ("MEMORY", False) in media and ("MEMORY", True) in media
    assert ("MEMORY_STORE", False) in media


def test_arc_policy_in_the_stack():
    manager, disk = make(cpu_blocks=2, policy=ARCPolicy)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])
    settle(manager)
    assert resolve(manager, key(0)) is True
    np.testing.assert_array_equal(load_bytes(manager, [key(0)])[0], payload(key(0), BLOCK))


def test_a_read_with_no_cpu_row_is_a_miss_for_a_step_not_a_livelock():
    manager, disk = make(cpu_blocks=2)
    store(manager, [key(0), key(1)])
    settle(manager)
    store(manager, [key(2), key(3)])
    manager.on_schedule_end()
    manager.on_schedule_end()  # 0 and 1 only on disk now; 2 and 3 clean in the CPU tier
    manager.prepare_load([key(2), key(3)], CTX)  # both CPU rows pinned by a long load
    assert manager.lookup(key(0), CTX) is None
    manager.on_schedule_end()  # no row, nothing being saved: the read is dropped
    assert manager.lookup(key(0), CTX) is False  # a miss for this step, not None again
    assert manager.stats()["promoting_blocks"] == 0
    manager.complete_load([key(2), key(3)], CTX)
    manager.on_schedule_end()
    assert resolve(manager, key(0)) is True  # rows are free again: the read goes through
    np.testing.assert_array_equal(load_bytes(manager, [key(0)])[0], payload(key(0), BLOCK))


def wear_stack(admission, tbw=600.0):
    backend = MemoryBackend(4, BLOCK)
    return TierStackManager(
        backend,
        LRUPolicy(4),
        [MemoryTier("disk", backend.rows, 8)],
        CascadeConfig(write_policy="write_through"),
        admission=[admission],
        endurance_tbw=[tbw],
    )


def test_projected_life_takes_its_write_rate_from_the_clock_the_stack_is_given():
    now = [1000.0]
    manager = wear_stack(None)
    manager.use_clock(lambda: now[0])  # as replay does: the trace's time
    store(manager, [key(0), key(1)])
    settle(manager)
    now[0] += 10.0  # ten seconds of that clock, however long the test took
    figures = manager.stats()
    rate = 2 * BLOCK / 10.0
    assert figures["disk.projected_life_days"] == round(600e12 / rate / 86400, 1)


def test_a_budgeted_tier_reports_one_life_its_budgets():
    from kvtier.policies.admission import AdmissionFilter
    from kvtier.policies.write_budget import WriteBudget

    now = [0.0]
    budget = WriteBudget(1000.0, 60.0, endurance_bytes=600e12, clock=lambda: now[0])
    manager = wear_stack(AdmissionFilter("budget", budget=budget, block_bytes=BLOCK, sketch_width=64))
    store(manager, [key(0), key(1)])
    settle(manager)
    now[0] = 30.0
    settle(manager)  # a step's tick: the budget measures its rate
    figures = manager.stats()
    assert figures["disk.bytes_written"] == 2 * BLOCK
    assert "disk.projected_life_years" in figures
    assert "disk.projected_life_days" not in figures  # not a second figure on another average


def test_reuse_admission_keeps_one_off_blocks_off_the_disk_and_counts_wear():
    from kvtier.policies.admission import AdmissionFilter

    backend = MemoryBackend(4, BLOCK)
    disk = MemoryTier("disk", backend.rows, 8)
    manager = TierStackManager(
        backend,
        LRUPolicy(4),
        [disk],
        CascadeConfig(write_policy="write_through"),
        admission=[AdmissionFilter("reuse", min_reuse=2, sketch_width=1 << 10)],
        endurance_tbw=[600.0],
    )
    assert manager.lookup(key(0), CTX) is False  # a miss: the offer that follows counts
    store(manager, [key(0), key(1)])  # wanted once each
    assert manager.lookup(key(0), CTX) is True  # a hit: 0 is wanted a second time
    settle(manager)
    assert disk.lookup(key(0)) is True and disk.lookup(key(1)) is False
    np.testing.assert_array_equal(disk_bytes(disk, key(0)), payload(key(0), BLOCK))
    figures = manager.stats()
    assert figures["dirty_blocks"] == 0  # the refused block is no longer held for saving
    assert (figures["disk.admitted_blocks"], figures["disk.refused_blocks"]) == (1, 1)
    assert figures["disk.bytes_written"] == BLOCK and figures["disk.bytes_read_later"] == 0
    assert "disk.write_amplification" not in figures  # nothing read back yet
    assert figures["disk.projected_life_days"] > 0
    # Evict both from the CPU tier: 0 comes back from the disk byte for byte, 1 is gone.
    store(manager, [key(i) for i in range(2, 6)])
    settle(manager)
    assert resolve(manager, key(0)) is True
    np.testing.assert_array_equal(load_bytes(manager, [key(0)])[0], payload(key(0), BLOCK))
    assert manager.lookup(key(1), CTX) is False
    figures = manager.stats()
    assert figures["disk.bytes_read_later"] == BLOCK
    assert figures["disk.write_amplification"] == figures["disk.bytes_written"] / BLOCK


def test_stats_after_shutdown_count_what_the_shutdown_saved():
    manager, disk = make(cpu_blocks=8, disk_blocks=16, write_policy="write_back")
    keys = [key(i) for i in range(3)]
    store(manager, keys)
    settle(manager)  # plenty of clean room: write_back saves nothing yet
    assert manager.stats()["disk.demoted_bytes"] == 0
    manager.shutdown()
    figures = manager.stats()  # the tiers are closed; these are the last figures
    assert figures["disk.demoted_bytes"] == 3 * BLOCK and figures["disk.demotions"] == 3
    assert all(np.array_equal(disk_bytes(disk, k), payload(k, BLOCK)) for k in keys)


def test_shutdown_ends_when_a_save_was_counted_but_never_sent(caplog):
    """A call cut short between its bookkeeping and its submit (a signal's exception, under
    the CLI) leaves a save counted with no job behind it: shutdown still ends, saying so."""
    manager, disk = make(write_policy="write_back")
    store(manager, [key(1), key(2)])
    settle(manager)
    orphan = key(3)
    manager._demoting[orphan] = 1  # as _demote leaves it when interrupted before its submit
    with caplog.at_level("WARNING", logger="kvtier.manager.stack"):
        manager.shutdown()
    assert "1 blocks were being saved by jobs that no longer report (0 jobs)" in caplog.text
    stats = manager.stats()  # as they were just before the tiers closed
    assert stats[f"{disk.name}.demotions"] == 2  # the real saves went through first


def test_shutdown_ends_when_a_job_was_counted_but_its_result_never_folded_in(caplog):
    """A signal's exception between a job's bookkeeping and its submit, or in the middle of a
    poll that had taken its result, leaves the job in the manager's books with no tier behind
    it (seen as a replay that SIGHUP left spinning): shutdown still ends, saying so."""
    import threading
    import time

    from kvtier.tiers.jobs import TierJob

    manager, disk = make(write_policy="write_back")
    store(manager, [key(1), key(2)])
    settle(manager)
    orphan = key(3)
    manager._demoting[orphan] = 1
    manager._jobs[999] = (0, TierJob(999, (orphan,), (0,)), False, time.monotonic())
    with caplog.at_level("WARNING", logger="kvtier.manager.stack"):
        closing = threading.Thread(target=manager.shutdown, daemon=True)
        closing.start()
        closing.join(timeout=60)
    assert not closing.is_alive(), "shutdown waited for ever on a job no tier runs"
    assert "1 blocks were being saved by jobs that no longer report (1 jobs)" in caplog.text
    assert manager.stats()[f"{disk.name}.demotions"] == 2


def saved_below_with_causes():
    """A CPU tier of 2 over a disk of 8, miss causes on, six keys stored and saved below (the
    first four gone from the CPU tier): (manager, disk, keys)."""
    from kvtier.manager.causes import MissCauses

    manager, disk = make(cpu_blocks=2, disk_blocks=8, causes=MissCauses(256, ["cpu", "disk"]))
    keys = [key(i) for i in range(6)]
    for k in keys:
        store(manager, [k])
        settle(manager)
    return manager, disk, keys


def test_a_failed_read_behind_a_miss_is_counted_once():
    """A key looked up None (its read queued) whose read fails is a miss, counted as the read
    fails; an engine that then reports it behind the request's first miss, or asks again,
    does not make it two."""
    manager, disk, keys = saved_below_with_causes()
    assert not manager.lookup(keys[0], CTX) and manager.lookup(keys[1], CTX) is None
    disk.corrupt(keys[1])
    settle(manager)  # the read of keys[1] fails verification: a corrupt miss
    before = manager.stats()
    manager.missed_behind([keys[1]], CTX)  # behind keys[0], which missed first
    assert manager.lookup(keys[1], CTX) is False  # asked again: the same miss
    after = manager.stats()
    assert after["miss_corrupt"] == before["miss_corrupt"] == 1
    assert sum(v for name, v in after.items() if name.startswith("miss_")) == after["misses"]


def test_a_read_that_fails_after_its_key_was_reported_behind_is_not_a_second_miss():
    manager, disk, keys = saved_below_with_causes()
    assert manager.lookup(keys[1], CTX) is None  # its read is queued
    manager.missed_behind([keys[1]], CTX)  # the engine computes it: behind, one miss
    disk.corrupt(keys[1])
    settle(manager)  # the read fails now, after it was counted
    stats = manager.stats()
    assert stats["miss_behind"] == 1 and stats["miss_corrupt"] == 0
    assert sum(v for name, v in stats.items() if name.startswith("miss_")) == stats["misses"] == 1

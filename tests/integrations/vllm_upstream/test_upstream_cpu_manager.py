"""vLLM's CPU manager tests (LRU and ARC), ported to 0.33's API and run against kvtier.

The subject is kvtier's manager over a CPU tier (``KvtierOffloadingManager`` over
``SingleTierManager``), built by vLLM's spec factory (the ``make_cpu_manager`` fixture) where
vLLM's tests build ``CPUOffloadingManager``. The scenarios and assertions are vLLM's; where
kvtier differs on purpose, the test says so and asserts kvtier's documented behaviour, and
README.md beside this file lists the difference with its reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.policies.arc import ARCPolicy

CTX = ReqContext(req_id="")
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


@dataclass
class Expected:
    keys_to_store: list[int]
    store_block_ids: list[int]
    evicted_keys: list[int]


def to_key(i: int) -> OffloadKey:
    return make_offload_key(str(i).encode(), 0)


def to_keys(ints: Iterable[int]) -> list[OffloadKey]:
    return [to_key(i) for i in ints]


def check_store(out: PrepareStoreOutput | None, expected: Expected) -> None:
    assert out is not None
    assert out.keys_to_store == to_keys(expected.keys_to_store)
    assert out.evicted_keys == to_keys(expected.evicted_keys)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    np.testing.assert_array_equal(
        out.store_spec.chunk_ids, np.array(expected.store_block_ids, dtype=np.int64)
    )


def check_load(spec, expected_ids: list[int]) -> None:
    assert isinstance(spec, CPULoadStoreSpec)
    np.testing.assert_array_equal(spec.chunk_ids, np.array(expected_ids, dtype=np.int64))


def check_events(
    events: Iterable[OffloadingEvent],
    stores: tuple[set[int], ...] = (),
    evictions: tuple[set[int], ...] = (),
) -> None:
    seen_stores, seen_evictions = [], []
    for event in events:
        assert event.medium is Medium.CPU
        (seen_evictions if event.removed else seen_stores).append(set(event.keys))
    assert tuple(seen_evictions) == tuple(set(to_keys(s)) for s in evictions)
    assert tuple(seen_stores) == tuple(set(to_keys(s)) for s in stores)


def slots(out: PrepareStoreOutput) -> list[int]:
    return out.store_spec.chunk_ids.tolist()


@pytest.mark.parametrize("eviction_policy", ["lru", "arc"])
def test_already_stored_block_not_evicted_during_prepare_store(make_cpu_manager, eviction_policy):
    manager = make_cpu_manager(num_blocks=4, cache_policy=eviction_policy, enable_events=True)
    manager.prepare_store(to_keys([1, 2]), CTX)
    manager.complete_store(to_keys([1, 2]), CTX)
    manager.touch(to_keys([1]), CTX)  # block 2 is now the LRU candidate
    out = manager.prepare_store(to_keys([2, 3, 4, 5]), CTX)
    # vLLM: keys [3, 4, 5] in slots [2, 3, 0], evicting [1]. kvtier hands out its free rows
    # in its own order (README: slot order); the rows are the two free ones and block 1's.
    assert out.keys_to_store == to_keys([3, 4, 5]) and out.evicted_keys == to_keys([1])
    assert sorted(slots(out)) == [0, 2, 3]
    manager.complete_store(to_keys([2, 3, 4, 5]), CTX)
    assert manager.lookup(to_key(2), CTX) is HIT


def test_cpu_manager(make_cpu_manager):
    manager = make_cpu_manager(num_blocks=4, cache_policy="lru", enable_events=True)

    check_store(manager.prepare_store(to_keys([1, 2]), CTX), Expected([1, 2], [0, 1], []))
    # write in flight: found, not yet readable (vLLM 0.33: HIT_PENDING)
    assert manager.lookup(to_key(1), CTX) is PENDING
    assert manager.lookup(to_key(2), CTX) is PENDING
    assert list(manager.take_events()) == []

    manager.complete_store(to_keys([1, 2]), CTX)
    check_events(manager.take_events(), stores=({1, 2},))
    assert manager.lookup(to_key(1), CTX) is HIT
    assert manager.lookup(to_key(2), CTX) is HIT
    assert manager.lookup(to_key(3), CTX) is MISS

    out = manager.prepare_store(to_keys([2, 3, 4, 5]), CTX)  # evicts [1]
    assert out.keys_to_store == to_keys([3, 4, 5]) and out.evicted_keys == to_keys([1])
    assert sorted(slots(out)) == [0, 2, 3]  # vLLM: [2, 3, 0] (README: slot order)
    rows = {k: row for k, row in zip(out.keys_to_store, slots(out))}
    rows[to_key(2)] = 1
    check_events(manager.take_events(), evictions=({1},))

    assert manager.prepare_store(to_keys([1, 6]), CTX) is None  # no space
    manager.complete_store(to_keys([2, 3, 4, 5]), CTX)
    assert manager.lookup(to_key(1), CTX) is MISS
    for i in (2, 3, 4, 5):
        assert manager.lookup(to_key(i), CTX) is HIT
    assert manager.lookup(to_key(0), CTX) is MISS

    check_load(manager.prepare_load(to_keys([2, 3]), CTX), [rows[to_key(2)], rows[to_key(3)]])
    assert manager.prepare_store(to_keys([6, 7, 8]), CTX) is None  # [2, 3] being loaded
    manager.complete_load(to_keys([2, 3]), CTX)

    out = manager.prepare_store(to_keys([6, 7, 8]), CTX)  # evicts [2, 3, 4] (oldest)
    # vLLM evicts [2, 3, 4]: a finished load does not refresh a block. Whether kvtier's
    # policies put a block whose load ended back at the recent end is issue #21 item 3
    # (eviction order), handled apart (README); until it settles, this port asserts what
    # holds either way: three blocks of the four stored before, never one of the offer.
    assert out.keys_to_store == to_keys([6, 7, 8]) and len(out.evicted_keys) == 3
    assert set(out.evicted_keys) < set(to_keys([2, 3, 4, 5]))
    evicted = out.evicted_keys
    # vLLM: slots [3, 2, 1], the evicted blocks' rows; kvtier: the same rows, its own order
    assert sorted(slots(out)) == sorted(rows[k] for k in evicted)
    rows.update(zip(out.keys_to_store, slots(out)))
    manager.complete_store(to_keys([6, 7, 8]), CTX)
    (kept,) = set(to_keys([2, 3, 4, 5])) - set(evicted)  # vLLM: 5

    manager.touch(to_keys([5, 6, 7]), CTX)  # to the end of the LRU order
    out = manager.prepare_store(to_keys([9]), CTX)  # evicts [8]: the oldest untouched
    victim = to_key(8) if kept == to_key(5) else kept
    assert out.keys_to_store == to_keys([9]) and out.evicted_keys == [victim]
    assert slots(out) == [rows[victim]]

    manager.complete_store(to_keys([7, 9]), CTX, success=False)
    assert manager.lookup(to_key(7), CTX) is HIT  # stored before: left alone
    assert manager.lookup(to_key(9), CTX) is MISS

    # vLLM's events, plus kvtier's metadata_only retraction of the failed store of [9]
    # (vLLM 0.33 emits it too; its test predates it).
    events = list(manager.take_events())
    retracted = [e for e in events if e.metadata_only]
    assert [(set(e.keys), e.removed) for e in retracted] == [(set(to_keys([9])), True)]
    removed = [set(e.keys) for e in events if e.removed and not e.metadata_only]
    stored = [set(e.keys) for e in events if not e.removed]
    assert stored == [set(to_keys([3, 4, 5])), set(to_keys([6, 7, 8]))]
    assert removed == [set(evicted), {victim}]  # vLLM: [{2, 3, 4}, {8}]


def test_prepare_load_preserves_key_order(make_cpu_manager):
    manager = make_cpu_manager(num_blocks=4, cache_policy="lru")
    a, b, c = to_key(0), to_key(1), to_key(2)
    out = manager.prepare_store([a, b, c], CTX)
    row = {k: int(r) for k, r in zip(out.keys_to_store, out.store_spec.chunk_ids)}
    manager.complete_store([a, b, c], CTX)

    forward = manager.prepare_load([a, b, c], CTX)
    assert [int(x) for x in forward.chunk_ids] == [row[a], row[b], row[c]]
    manager.complete_load([a, b, c], CTX)
    permuted = manager.prepare_load([b, c, a], CTX)
    assert [int(x) for x in permuted.chunk_ids] == [row[b], row[c], row[a]]
    manager.complete_load([a, b, c], CTX)


def test_evictable_block_count(make_cpu_manager):
    """vLLM checks its private ``_num_evictable_cache_blocks``; kvtier's figure for it is the
    tier's ``ready_blocks - held_blocks`` (README: private counters). Same scenario."""
    manager = make_cpu_manager(num_blocks=4, cache_policy="lru")

    def evictable() -> int:
        figures = manager.stats()
        return figures["ready_blocks"] - figures["held_blocks"]

    assert evictable() == 0
    manager.prepare_store(to_keys([1, 2, 3]), CTX)
    assert evictable() == 0  # being written
    manager.complete_store(to_keys([1, 2, 3]), CTX)
    assert evictable() == 3
    manager.prepare_load(to_keys([1]), CTX)
    assert evictable() == 2
    manager.prepare_load(to_keys([1]), CTX)  # a second concurrent reader
    assert evictable() == 2
    manager.complete_load(to_keys([1]), CTX)
    assert evictable() == 2  # one reader left
    manager.complete_load(to_keys([1]), CTX)
    assert evictable() == 3
    manager.prepare_store(to_keys([4, 5, 6]), CTX)  # one free row, two evictions
    assert evictable() == 1
    manager.complete_store(to_keys([4, 5, 6]), CTX, success=False)
    assert evictable() == 1
    manager.reset_cache()
    manager.on_reset_flushed()
    assert evictable() == 0

    manager.prepare_store(to_keys([10, 11, 12]), CTX)
    manager.complete_store(to_keys([10, 11, 12]), CTX)
    manager.prepare_load(to_keys([10, 11, 12]), CTX)
    assert evictable() == 0
    assert manager.prepare_store(to_keys([14, 15]), CTX) is None  # nothing evictable
    manager.complete_load(to_keys([10, 11, 12]), CTX)
    assert evictable() == 3
    assert manager.prepare_store(to_keys([14, 15]), CTX) is not None
    assert evictable() == 2
    manager.complete_store(to_keys([14, 15]), CTX)
    assert evictable() == 4


class TestARCPolicy:
    """vLLM's ARC tests. kvtier's ARC keeps its lists private; ``lists`` reads them (held keys
    counted in the list they belong to, as vLLM's ARC does)."""

    @pytest.fixture
    def make(self, make_cpu_manager):
        def make(num_blocks: int = 4, enable_events: bool = True):
            manager = make_cpu_manager(num_blocks, "arc", enable_events)
            assert isinstance(manager.inner.policy, ARCPolicy)
            return manager, manager.inner.policy

        return make

    @staticmethod
    def lists(policy: ARCPolicy) -> tuple[set, set, set, set]:
        t2 = set(policy._t2) | set(policy._held_t2)
        t1 = set(policy._index) - t2
        return t1, t2, set(policy._b1), set(policy._b2)

    def test_basic(self, make):
        manager, policy = make()
        check_store(manager.prepare_store(to_keys([1, 2]), CTX), Expected([1, 2], [0, 1], []))
        assert manager.lookup(to_key(1), CTX) is PENDING
        assert manager.lookup(to_key(2), CTX) is PENDING
        assert list(manager.take_events()) == []
        manager.complete_store(to_keys([1, 2]), CTX)
        check_events(manager.take_events(), stores=({1, 2},))
        assert manager.lookup(to_key(1), CTX) is HIT
        assert manager.lookup(to_key(2), CTX) is HIT
        assert manager.lookup(to_key(3), CTX) is MISS
        t1, t2, _, _ = self.lists(policy)
        assert len(t1) == 2 and len(t2) == 0

    def test_t1_to_t2_promotion(self, make):
        manager, policy = make(enable_events=False)
        manager.prepare_store(to_keys([1]), CTX)
        manager.complete_store(to_keys([1]), CTX)
        t1, t2, _, _ = self.lists(policy)
        assert to_key(1) in t1 and to_key(1) not in t2
        manager.touch(to_keys([1]), CTX)
        t1, t2, _, _ = self.lists(policy)
        assert to_key(1) not in t1 and to_key(1) in t2

    def test_eviction_with_load(self, make):
        manager, _ = make()
        check_store(
            manager.prepare_store(to_keys([1, 2, 3, 4]), CTX),
            Expected([1, 2, 3, 4], [0, 1, 2, 3], []),
        )
        manager.complete_store(to_keys([1, 2, 3, 4]), CTX)
        check_load(manager.prepare_load(to_keys([2, 3]), CTX), [1, 2])
        assert manager.prepare_store(to_keys([5, 6, 7]), CTX) is None  # [2, 3] pinned
        manager.complete_load(to_keys([2, 3]), CTX)
        out = manager.prepare_store(to_keys([5, 6, 7]), CTX)
        assert out is not None and len(out.evicted_keys) >= 1

    def test_adaptive_target(self, make):
        """vLLM's ARC learns from a touch of a ghost key (a miss in its terms); kvtier's from
        the store of one, since a tier sees a miss only as the store that follows it (README:
        ARC learns on store). Same scenario, the ghost hit made by storing block 1 again."""
        manager, policy = make(num_blocks=2, enable_events=False)
        manager.prepare_store(to_keys([1, 2]), CTX)
        manager.complete_store(to_keys([1, 2]), CTX)
        initial = policy.target_t1_blocks
        # kvtier keeps the paper's ghost bound |t1| + |b1| <= c: with t1 = {2, 3} after the
        # next store, 1 would leave no ghost. Block 2 is used again first, so t1 has room for
        # the ghost (README: ARC ghost bounds).
        manager.touch(to_keys([2]), CTX)
        manager.prepare_store(to_keys([3]), CTX)  # evicts 1 into b1
        manager.complete_store(to_keys([3]), CTX)
        assert to_key(1) in self.lists(policy)[2]
        manager.touch(to_keys([1]), CTX)
        assert policy.target_t1_blocks == initial  # a touch of an absent key changes nothing
        manager.prepare_store(to_keys([1]), CTX)  # the ghost hit
        manager.complete_store(to_keys([1]), CTX)
        assert policy.target_t1_blocks > initial

    def test_t1_t2_eviction_policy(self, make):
        manager, policy = make(enable_events=False)
        manager.prepare_store(to_keys([1, 2, 3, 4]), CTX)
        manager.complete_store(to_keys([1, 2, 3, 4]), CTX)
        manager.touch(to_keys([3, 4]), CTX)
        t1, t2, _, _ = self.lists(policy)
        assert len(t1) == 2 and len(t2) == 2
        policy._p = 1  # vLLM sets target_t1_size; kvtier's target is read-only (README)
        out = manager.prepare_store(to_keys([5]), CTX)
        # t1 holds 1 and 2 of one store call: kvtier lays a call's keys tail first, so the
        # tail (2) goes before the head (1); vLLM inserts in call order and evicts 1
        # (README: a prefix's tail goes first)
        assert out is not None and out.evicted_keys == to_keys([2])
        manager.complete_store(to_keys([5]), CTX)
        t1, _, b1, _ = self.lists(policy)
        assert to_key(2) in b1 and to_key(5) in t1

    def test_ghost_list_bounds(self, make):
        manager, policy = make(num_blocks=2, enable_events=False)
        manager.prepare_store(to_keys([1, 2]), CTX)
        manager.complete_store(to_keys([1, 2]), CTX)
        for i in range(3, 20):
            manager.prepare_store(to_keys([i]), CTX)
            manager.complete_store(to_keys([i]), CTX)
        _, _, b1, b2 = self.lists(policy)
        assert len(b1) <= policy.capacity_blocks and len(b2) <= policy.capacity_blocks

    def test_touch_ordering(self, make):
        manager, policy = make()
        manager.prepare_store(to_keys([1, 2, 3, 4]), CTX)
        manager.complete_store(to_keys([1, 2, 3, 4]), CTX)
        manager.touch(to_keys([3, 4]), CTX)
        manager.touch(to_keys([1, 3, 4]), CTX)
        t1, t2, _, _ = self.lists(policy)
        assert len(t1) == 1 and len(t2) == 3
        check_store(manager.prepare_store(to_keys([5]), CTX), Expected([5], [1], [2]))

    def test_failed_store(self, make):
        manager, policy = make()
        manager.prepare_store(to_keys([1, 2, 3, 4]), CTX)
        manager.complete_store(to_keys([1, 2, 3, 4]), CTX)
        out = manager.prepare_store(to_keys([5]), CTX)
        assert out is not None and len(out.evicted_keys) == 1
        manager.complete_store(to_keys([5]), CTX, success=False)
        assert manager.lookup(to_key(5), CTX) is MISS
        t1, t2, b1, _ = self.lists(policy)
        assert to_key(5) not in t1 and to_key(5) not in t2
        assert out.evicted_keys[0] in b1

    def test_full_scenario(self, make):
        manager, policy = make()
        manager.prepare_store(to_keys([1, 2]), CTX)
        manager.complete_store(to_keys([1, 2]), CTX)
        out = manager.prepare_store(to_keys([3, 4, 5]), CTX)
        assert out is not None and len(out.evicted_keys) == 1
        manager.complete_store(to_keys([3, 4, 5]), CTX)
        # the store of [3, 4, 5] evicted 2, the tail of [1, 2] (kvtier lays a call's keys
        # tail first; vLLM evicts 1): the scenario touches the head that stayed, 1, where
        # vLLM's touches 2
        assert to_key(2) not in self.lists(policy)[0] and to_key(1) in self.lists(policy)[0]
        manager.touch(to_keys([1, 3]), CTX)
        t1, t2, _, _ = self.lists(policy)
        assert len(t1) == 2 and len(t2) == 2
        out = manager.prepare_store(to_keys([6]), CTX)
        assert out is not None
        manager.complete_store(to_keys([6]), CTX)
        assert manager.lookup(to_key(1), CTX) is HIT
        assert manager.lookup(to_key(3), CTX) is HIT
        assert len(list(manager.take_events())) > 0

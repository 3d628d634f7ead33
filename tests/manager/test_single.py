import numpy as np
import pytest

from kvtier_testing import key, payload, read_blocks, store_blocks
from kvtier.base import OffloadingEvent, ReqContext, RequestOffloadingContext
from kvtier.errors import BlockStateError
from kvtier.manager.single import SingleTierManager
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend, NullBackend

CTX = ReqContext("req-0")
BLOCK = 64


@pytest.fixture(params=[LRUPolicy, ARCPolicy], ids=["lru", "arc"])
def manager(request):
    return SingleTierManager(MemoryBackend(4, BLOCK), request.param(4))


def store(manager, keys, success=True):
    return store_blocks(manager, keys, CTX, success)


def read(manager, keys):
    return read_blocks(manager, keys, CTX)


def test_store_then_load_round_trips_bytes(manager):
    keys = [key(i) for i in range(3)]
    out = store(manager, keys)
    assert out.keys_to_store == keys and out.evicted_keys == []
    assert out.store_spec.medium() == "MEMORY"
    assert all(manager.lookup(k, CTX) is True for k in keys)
    for k, got in zip(keys, read(manager, keys)):
        np.testing.assert_array_equal(got, payload(k, BLOCK))


def test_pending_blocks_are_invisible_and_not_restored(manager):
    out = manager.prepare_store([key(0)], CTX)
    assert out.keys_to_store == [key(0)]
    assert manager.lookup(key(0), CTX) is False
    again = manager.prepare_store([key(0)], CTX)  # being written: skipped, not stored twice
    assert again.keys_to_store == [] and len(again.store_spec) == 0
    manager.complete_store([key(0)], CTX)
    assert manager.lookup(key(0), CTX) is True


def test_repeated_keys_in_one_offer_take_one_slot(manager):
    out = manager.prepare_store([key(0), key(0), key(1)], CTX)
    assert out.keys_to_store == [key(0), key(1)]
    assert manager.stats()["free_blocks"] == 2


def block_counts(manager):
    """stats() without what the policy learnt (``policy_*``: ARC's target, chain's share)."""
    return {name: value for name, value in manager.stats().items() if not name.startswith("policy_")}


def test_failed_store_removes_only_the_blocks_being_written(manager):
    store(manager, [key(0)])
    manager.prepare_store([key(0), key(1)], CTX)
    manager.complete_store([key(0), key(1)], CTX, success=False)
    assert manager.lookup(key(0), CTX) is True  # was ready: stays
    assert manager.lookup(key(1), CTX) is False
    assert block_counts(manager) == {
        "ready_blocks": 1,
        "pending_blocks": 0,
        "held_blocks": 0,
        "free_blocks": 3,
        "evictions": 0,
    }


def test_eviction_spares_pinned_and_offered_blocks(manager):
    store(manager, [key(i) for i in range(4)])
    manager.prepare_load([key(0)], CTX)  # pinned
    out = manager.prepare_store([key(1), key(4), key(5)], CTX)  # key 1 is offered and ready
    assert out is not None
    assert sorted(out.evicted_keys) == sorted([key(2), key(3)])
    assert manager.lookup(key(0), CTX) and manager.lookup(key(1), CTX)


def test_prepare_store_is_all_or_nothing(manager):
    store(manager, [key(i) for i in range(4)])
    manager.prepare_load([key(0), key(1), key(2)], CTX)
    before = manager.stats()
    assert manager.prepare_store([key(10), key(11)], CTX) is None  # only key 3 evictable
    assert manager.stats() == before
    assert all(manager.lookup(key(i), CTX) for i in range(4))
    assert manager.prepare_store([key(i) for i in range(10, 15)], CTX) is None  # > capacity


def test_pinned_slot_is_not_reused_until_complete_load(manager):
    store(manager, [key(i) for i in range(4)])
    spec = manager.prepare_load([key(0)], CTX)
    pinned_row = int(spec.block_ids[0])
    for i in range(4, 12):  # churn through the other three slots
        store(manager, [key(i)])
        np.testing.assert_array_equal(manager.backend.rows[pinned_row], payload(key(0), BLOCK))
    manager.complete_load([key(0)], CTX)
    store(manager, [key(20), key(21), key(22), key(23)])
    assert manager.lookup(key(0), CTX) is False


def test_pins_are_counted(manager):
    store(manager, [key(0)])
    manager.prepare_load([key(0)], CTX)
    manager.prepare_load([key(0)], CTX)
    manager.complete_load([key(0)], CTX)
    assert manager.stats()["held_blocks"] == 1
    manager.complete_load([key(0)], CTX)
    assert manager.stats()["held_blocks"] == 0


def test_prepare_load_of_a_missing_key_raises(manager):
    with pytest.raises(BlockStateError, match="not a ready block"):
        manager.prepare_load([key(0)], CTX)
    manager.prepare_store([key(1)], CTX)
    with pytest.raises(BlockStateError):
        manager.prepare_load([key(1)], CTX)  # still being written
    assert manager.stats()["held_blocks"] == 0


def test_touch_changes_lru_victim():
    manager = SingleTierManager(MemoryBackend(2, BLOCK), LRUPolicy(2))
    store(manager, [key(0), key(1)])
    manager.touch([key(0)], CTX)
    out = manager.prepare_store([key(2)], CTX)
    assert out.evicted_keys == [key(1)]


def test_events_follow_what_lookup_can_see(manager):
    store(manager, [key(0), key(1)])
    manager.prepare_store([key(2)], CTX)
    manager.complete_store([key(2)], CTX, success=False)  # never visible: metadata_only
    store(manager, [key(i) for i in range(3, 6)])  # evicts 1 block... or more
    events = list(manager.take_events())
    assert list(manager.take_events()) == []
    visible: set = set()
    retracted = [event.keys for event in events if event.metadata_only]
    assert retracted == [[key(2)]]
    for event in events:
        assert isinstance(event, OffloadingEvent)
        assert event.block_size == BLOCK and event.medium == "MEMORY"
        if event.metadata_only:
            assert event.removed and not set(event.keys) & visible
        elif event.removed:
            assert set(event.keys) <= visible
            visible -= set(event.keys)
        else:
            visible |= set(event.keys)
    assert visible == {k for k in map(key, range(6)) if manager.lookup(k, CTX)}


def test_events_off():
    manager = SingleTierManager(MemoryBackend(2, BLOCK), LRUPolicy(2), enable_events=False)
    store(manager, [key(0)])
    assert list(manager.take_events()) == []


def test_reset_cache_forgets_everything_and_ignores_stale_completions(manager):
    store(manager, [key(0), key(1)])
    manager.prepare_load([key(0)], CTX)
    manager.prepare_store([key(2)], CTX)
    manager.reset_cache()
    assert block_counts(manager) == {
        "ready_blocks": 0,
        "pending_blocks": 0,
        "held_blocks": 0,
        "free_blocks": 4,
        "evictions": 0,
    }
    manager.complete_load([key(0)], CTX)
    manager.complete_store([key(2)], CTX)
    assert not any(manager.lookup(key(i), CTX) for i in range(3))
    removed = [e for e in manager.take_events() if e.removed and not e.metadata_only]
    assert {k for e in removed for k in e.keys} == {key(0), key(1)}


def test_request_hooks_and_shutdown(manager):
    assert manager.on_new_request(CTX) == RequestOffloadingContext()
    manager.on_request_finished(CTX)
    manager.on_schedule_end()
    store(manager, [key(0)])
    manager.shutdown()
    manager.shutdown()
    assert manager.lookup(key(0), CTX) is False


def test_null_backend_refuses_every_store():
    manager = SingleTierManager(NullBackend(BLOCK), LRUPolicy(0))
    assert manager.prepare_store([key(0)], CTX) is None
    assert manager.prepare_store([], CTX).keys_to_store == []


class _OwnContains(LRUPolicy):
    """A policy whose ``contains`` is its own method (an out-of-tree policy's shape)."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.contains = lambda key: key in self._index


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("policy", [LRUPolicy, ARCPolicy, _OwnContains], ids=["lru", "arc", "own"])
@pytest.mark.parametrize("causes", [True, False], ids=["causes", "no-causes"])
def test_lookup_answers_and_notes_misses_the_same_in_c_and_python(monkeypatch, path, policy, causes):
    """The lookup (C where kvtier._speedups is built, a closure else): a ready key is True, a
    key being written False and not a miss, any other key False and noted for its cause, in
    order; bad calls fail as a function's would."""
    import kvtier.manager.single as single
    from kvtier.manager.causes import MissCauses

    if path == "c" and single.speedups is None:
        pytest.skip("kvtier._speedups is not built here (no C compiler at install)")
    if path == "python":
        monkeypatch.setattr(single, "speedups", None)
    manager = SingleTierManager(
        MemoryBackend(4, BLOCK), policy(4), causes=MissCauses(64, ["cpu"]) if causes else None
    )
    expect_c = path == "c" and policy is not _OwnContains
    assert (type(manager.lookup).__module__ == "kvtier._speedups") is expect_c
    store(manager, [key(0), key(1)])
    manager.prepare_store([key(2)], CTX)  # being written
    answers = [manager.lookup(k, CTX) for k in (key(0), key(2), key(3), key(1), key(4), key(3))]
    assert answers == [True, False, False, True, False, False]
    if causes:
        assert manager.miss_causes.missed == [key(3), key(4), key(3)]
        assert manager.stats()["miss_new"] == 3
    with pytest.raises(TypeError):
        manager.lookup(key(0))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        manager.lookup([1], CTX)  # unhashable: no key of any tier
    manager.complete_store([key(2)], CTX)
    assert manager.lookup(key(2), CTX) is True

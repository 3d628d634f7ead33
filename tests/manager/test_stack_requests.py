"""The tier stack's answers to what a request asks for: the tiers it may load from, and room
for an offer larger than write_back's usual clean headroom."""

import numpy as np
import pytest
from kvtier_testing import key, payload, read_blocks, store_blocks

from kvtier.base import LoadTiers, ReqContext
from kvtier.config import CascadeConfig
from kvtier.manager.stack import REFUSED_OFFER_MEMORY_STEPS, TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend, MemoryTier

BLOCK = 64


def make(cpu_blocks=4, disk_blocks=4096, write_policy="write_back"):
    backend = MemoryBackend(cpu_blocks, BLOCK)
    disk = MemoryTier("disk", backend.rows, disk_blocks)
    manager = TierStackManager(
        backend, LRUPolicy(cpu_blocks), [disk], CascadeConfig(write_policy=write_policy)
    )
    return manager, disk


def only_on_disk(manager, keys):
    """Store ``keys``, save them below, then forget the CPU tier: the disk alone holds them."""
    store_blocks(manager, keys, ReqContext("writer"))
    manager.flush()
    manager.reset_cache()


def limited(req_id, *names):
    ctx = ReqContext(req_id)
    ctx.set_state(LoadTiers(frozenset(names)))
    return ctx


@pytest.mark.parametrize("names", [(), ("cpu",), ("elsewhere",)])
def test_a_request_not_allowed_the_disk_misses_and_starts_no_read(names):
    manager, disk = make()
    only_on_disk(manager, [key(0)])
    ctx = limited("r", *names)
    for _ in range(3):  # as an engine would ask, step after step
        assert manager.lookup(key(0), ctx) is False
        assert not manager.is_promoting(key(0))
        manager.on_schedule_end()
    assert manager.stats()["disk.promote_jobs"] == 0
    assert disk.lookup(key(0)) is True  # still there for requests that may read it


def test_a_request_allowed_the_disk_is_served_from_it():
    manager, _ = make()
    only_on_disk(manager, [key(0)])
    ctx = limited("r", "disk")
    assert manager.lookup(key(0), ctx) is None  # promoting
    manager.on_schedule_end()
    manager.on_schedule_end()
    assert manager.lookup(key(0), ctx) is True
    np.testing.assert_array_equal(read_blocks(manager, [key(0)], ctx)[0], payload(key(0), BLOCK))


def test_the_cpu_tier_answers_whatever_the_limit():
    manager, _ = make()
    store_blocks(manager, [key(0)], ReqContext("writer"))
    ctx = limited("r")
    assert manager.lookup(key(0), ctx) is True
    np.testing.assert_array_equal(read_blocks(manager, [key(0)], ctx)[0], payload(key(0), BLOCK))


def test_a_block_another_request_is_promoting_is_pending_for_a_limited_one_too():
    manager, _ = make()
    only_on_disk(manager, [key(0)])
    assert manager.lookup(key(0), ReqContext("free")) is None
    # already on its way into the CPU tier, which every request may load from
    assert manager.lookup(key(0), limited("r")) is None
    manager.on_schedule_end()
    manager.on_schedule_end()
    assert manager.lookup(key(0), limited("r")) is True


@pytest.mark.parametrize(("capacity", "offer"), [(5, 2), (64, 17), (1024, 257)])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_an_offer_larger_than_the_clean_headroom_is_placed_within_a_few_steps(capacity, offer, write_policy):
    """A CPU tier full of unsaved blocks: write_back used to keep a quarter of it clean and no
    more, so an offer larger than that was refused for ever."""
    manager, disk = make(cpu_blocks=capacity, write_policy=write_policy)
    ctx = ReqContext("r")
    store_blocks(manager, [key(i) for i in range(capacity)], ctx)
    new = [key(capacity + i) for i in range(offer)]
    for step in range(6):
        out = manager.prepare_store(new, ctx)
        if out is not None:
            placed_at = step
            break
        manager.on_schedule_end()
    else:
        raise AssertionError(f"an offer of {offer} into {capacity} rows was never placed")
    assert placed_at <= 3
    assert out.keys_to_store == new and all(disk.lookup(k) for k in out.evicted_keys)
    rows = manager.backend.rows
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids):
        rows[row] = payload(k, BLOCK)
    manager.complete_store(new, ctx)
    for k, got in zip(new, read_blocks(manager, new, ctx)):
        np.testing.assert_array_equal(got, payload(k, BLOCK))


def test_write_back_forgets_a_refused_offer_once_it_is_placed_or_stale():
    manager, disk = make(cpu_blocks=8)
    ctx = ReqContext("r")
    store_blocks(manager, [key(i) for i in range(8)], ctx)
    assert manager.prepare_store([key(100 + i) for i in range(5)], ctx) is None
    assert manager._clean_goal() == 5
    for _ in range(REFUSED_OFFER_MEMORY_STEPS + 1):
        manager._clean_goal()
    assert manager._clean_goal() == 2  # back to a quarter of 8: the request has gone
    assert disk.num_blocks() == 0  # nothing was stepped, so nothing was saved

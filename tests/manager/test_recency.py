"""Recency as vLLM 0.33 keeps it: a prefix leaves from its tail, and what a request re-offers
or loads is refreshed by its offer and its end, never by a ``touch`` (vLLM's connector never
calls one)."""

import pytest
from helpers import key, read_blocks, store_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.base import ReqContext
from kvtier.manager.single import SingleTierManager
from kvtier.policies import get_policy_class, registered_policies
from kvtier.testing import MemoryBackend

BLOCK = 16
#: the policies that keep a recency order a refresh can move (S3-FIFO and SIEVE keep arrival
#: order and only count uses)
ORDERED = ("lru", "arc", "chain")


def make(name, blocks=6):
    return SingleTierManager(MemoryBackend(blocks, BLOCK), get_policy_class(name)(blocks))


def request(manager, store=(), reoffer=(), load=(), req_id="r"):
    """One request as vLLM's connector drives it: loads, one offer, then its end."""
    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    if load:
        read_blocks(manager, [key(i) for i in load], ctx)
    offer = [key(i) for i in (*reoffer, *store)]
    if offer:
        store_blocks(manager, offer, ctx)
    manager.on_request_finished(ctx)


def evicted_by_next_store(manager, count, first=100):
    out = store_blocks(manager, [key(first + i) for i in range(count)], ReqContext("next"))
    return out.evicted_keys


@pytest.mark.parametrize("name", registered_policies())
def test_the_issues_six_blocks_one_request_then_a_reoffer(name):
    manager = make(name)
    request(manager, store=range(6), req_id="a")
    request(manager, reoffer=(0, 1, 2), req_id="b")  # still on its GPU: offered, not loaded
    assert evicted_by_next_store(manager, 3) == [key(5), key(4), key(3)]


@pytest.mark.parametrize("name", registered_policies())
def test_a_reoffered_older_prefix_outlives_a_newer_one(name):
    manager = make(name)
    request(manager, store=(0, 1, 2), req_id="a")
    request(manager, store=(3, 4, 5), req_id="b")
    request(manager, reoffer=(0, 1, 2), req_id="c")
    # without the re-offer refreshing them, [2, 1, 0] (the oldest) would go
    assert evicted_by_next_store(manager, 3) == [key(5), key(4), key(3)]


@pytest.mark.parametrize("name", registered_policies())
def test_a_loaded_prefix_is_refreshed_without_a_touch(name):
    manager = make(name)
    request(manager, store=(0, 1, 2), req_id="a")
    request(manager, store=(3, 4, 5), req_id="b")
    request(manager, load=(0, 1, 2), req_id="c")
    assert evicted_by_next_store(manager, 3) == [key(5), key(4), key(3)]


@pytest.mark.parametrize("name", ORDERED)
def test_a_reoffer_refreshes_at_once_for_a_request_still_running(name):
    manager = make(name)
    request(manager, store=(0, 1, 2), req_id="a")
    request(manager, store=(3, 4, 5), req_id="b")
    running = ReqContext("c")
    manager.on_new_request(running)
    store_blocks(manager, [key(0), key(1), key(2)], running)  # re-offered; c goes on decoding
    assert evicted_by_next_store(manager, 3) == [key(5), key(4), key(3)]
    manager.on_request_finished(running)


@pytest.mark.parametrize("name", ORDERED)
def test_a_store_completing_after_its_request_ended_stays_behind_its_head(name):
    manager = make(name, blocks=7)
    ctx = ReqContext("a")
    store_blocks(manager, [key(0), key(1), key(2)], ctx)
    late = manager.prepare_store([key(3), key(4), key(5)], ctx)  # its last chunk, in flight
    manager.on_request_finished(ctx)
    request(manager, store=(6,), req_id="b")
    manager.complete_store(late.keys_to_store, ctx)  # ready after a's end, and after b's block
    # a's blocks are laid over again, head newest: its tail goes before its head
    evicted = evicted_by_next_store(manager, 4)
    assert evicted == [key(6), key(5), key(4), key(3)]


class PositionedContext(ReqContext):
    """vLLM 0.33's ReqContext records each key's end token; kvtier reads it if it is there."""

    def __init__(self, req_id):
        super().__init__(req_id)
        self.positions = {}

    def get_offload_key_position(self, k):
        return self.positions.get(k)


@pytest.mark.parametrize("name", ORDERED)
def test_keys_stored_out_of_order_are_ordered_by_their_positions(name):
    manager = make(name)
    ctx = PositionedContext("a")
    for i in range(6):
        ctx.positions[key(i)] = (i + 1) * 256
    store_blocks(manager, [key(3), key(4), key(5)], ctx)  # a sliding-window backfill: the
    store_blocks(manager, [key(0), key(1), key(2)], ctx)  # head arrives last
    manager.on_request_finished(ctx)
    assert evicted_by_next_store(manager, 3) == [key(5), key(4), key(3)]


def test_finishing_twice_or_without_a_key_changes_nothing():
    manager = make("lru", blocks=4)
    request(manager, store=(0, 1, 2), req_id="a")
    ctx = ReqContext("b")
    manager.on_request_finished(ctx)  # never named a key: no state
    store_blocks(manager, [key(3)], ctx)
    manager.on_request_finished(ctx)
    manager.on_request_finished(ctx)  # a second end is ignored
    assert evicted_by_next_store(manager, 3, first=50) == [key(2), key(1), key(0)]


# -- properties --------------------------------------------------------------------------------

chains_st = st.lists(st.integers(1, 6), min_size=1, max_size=40)


@pytest.mark.parametrize("name", registered_policies())
@settings(max_examples=40, deadline=None)
@given(lengths=chains_st, capacity=st.integers(6, 24))
def test_without_reuse_no_policy_keeps_a_later_key_of_a_request_once_an_earlier_one_left(
    name, lengths, capacity
):
    """Requests each storing a new prefix, nothing reused: eviction takes every request's
    blocks from its tail, whatever the policy."""
    manager = make(name, blocks=capacity)
    chains, next_id = [], 0
    for index, length in enumerate(lengths):
        chain = list(range(next_id, next_id + length))
        next_id += length
        request(manager, store=chain, req_id=f"r{index}")
        chains.append(chain)
        for earlier in chains:
            present = [manager.lookup(key(i), None) for i in earlier]
            assert present == sorted(present, reverse=True), (earlier, present)


# a request is a walk down a small prefix tree: a branch of 3 at each of up to 8 levels
walks_st = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(walks=walks_st, capacity=st.integers(8, 30))
def test_lru_never_keeps_a_block_whose_prefix_left(walks, capacity):
    """Prefix-tree traffic with reuse through the manager as vLLM drives it (load the leading
    run found, offer the rest, end): under LRU a cached block's parent is always cached."""
    manager = make("lru", blocks=capacity)
    ids: dict[tuple, int] = {}
    parent: dict[int, int] = {}
    for index, walk in enumerate(walks):
        chain = []
        for depth in range(1, len(walk) + 1):
            node = ids.setdefault(tuple(walk[:depth]), len(ids))
            if chain:
                parent[node] = chain[-1]
            chain.append(node)
        found = 0
        while found < len(chain) and manager.lookup(key(chain[found]), None):
            found += 1
        request(manager, load=chain[:found], store=chain[found:], req_id=f"r{index}")
        for node, up in parent.items():
            if manager.lookup(key(node), None):
                assert manager.lookup(key(up), None), f"block {node} cached without its parent {up}"

"""Exact eviction orders of S3-FIFO, SIEVE and the prefix-chain policy, and their shared contract."""

import pytest

from helpers import key
from kvtier.policies import get_policy_class
from kvtier.policies.chain import ChainPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy
from kvtier.policies.sieve import SIEVEPolicy


def filled(cls, n, capacity=None):
    """Keys 0..n-1 stored one call each (one request each): key 0 the oldest."""
    policy = cls(capacity or n)
    for i in range(n):
        policy.insert([key(i)], [i])
    return policy


def victims(policy, count, skip=()):
    out = policy.evict(count, set(skip))
    assert out is not None
    return [k for k, _ in out]


def test_sieve_spares_visited_blocks_once_and_keeps_the_hand():
    policy = filled(SIEVEPolicy, 5)
    policy.touch([key(0), key(2)])
    # The hand passes 0 (clearing its bit), drops 1, passes 2, drops 3.
    assert victims(policy, 2) == [key(1), key(3)]
    policy.insert([key(5)], [1])
    # The hand stays after 3, not back at the oldest: 4 goes, then the newcomer 5 (never
    # used) before 0, whose spared pass already happened.
    assert victims(policy, 2) == [key(4), key(5)]
    assert victims(policy, 1) == [key(0)]  # wrapped round: 0's bit was cleared
    assert list(policy) == [key(2)]


def test_sieve_held_key_is_passed_and_returns_at_the_newest_end():
    policy = filled(SIEVEPolicy, 3)
    policy.hold(key(0))
    assert policy.evictable_blocks() == 2
    assert victims(policy, 1) == [key(1)]
    policy.release(key(0))
    assert victims(policy, 2) == [key(2), key(0)]


def test_s3fifo_one_hit_wonders_leave_through_the_small_queue_and_ghosts_go_to_main():
    policy = filled(S3FIFOPolicy, 10)
    policy.touch([key(1)])
    # Small holds all 10 (>= 10%): 0 is dropped; 1 was used, so it moves to main; 2 dropped.
    assert victims(policy, 2) == [key(0), key(2)]
    assert key(1) in policy._main and key(0) in policy._ghost
    policy.insert([key(0)], [0])  # a ghost stored again goes straight to main
    assert key(0) in policy._main
    assert victims(policy, 3) == [key(3), key(4), key(5)]


def test_s3fifo_main_queue_reinserts_used_blocks_with_one_use_fewer():
    policy = filled(S3FIFOPolicy, 4, capacity=40)
    for k in range(4):
        policy.insert([key(10 + k)], [10 + k])
    policy.touch([key(0), key(1)])
    assert victims(policy, 4) == [key(2), key(3), key(10), key(11)]
    # small (2 of 6 ready) is under 10%? no: 2 >= 0.6, so small goes on: 12, 13.
    assert victims(policy, 2) == [key(12), key(13)]
    # Only main is left: 0 and 1 have one use each; both get a second pass, then 0 goes.
    assert victims(policy, 1) == [key(0)]
    assert list(policy) == [key(1)]


def test_chain_evicts_a_chain_from_its_tail_and_keeps_hit_prefixes():
    policy = ChainPolicy(10, protected_share=0.8)
    policy.insert([key(0), key(1), key(2)], [0, 1, 2])  # one request's chain, head first
    policy.insert([key(3), key(4)], [3, 4])
    # Tail first within a chain, older chains first: 2, 1, 0, then 4.
    assert victims(policy, 4) == [key(2), key(1), key(0), key(4)]
    policy.insert([key(5), key(6)], [0, 1])
    policy.touch([key(5), key(6)])  # a hit: both move to protected, the head most recent
    policy.insert([key(7)], [2])
    assert victims(policy, 3) == [key(3), key(7), key(6)]


def test_chain_protected_share_overflows_back_to_probation_and_ghosts_return_protected():
    policy = ChainPolicy(5, protected_share=0.8)  # protected may hold 4
    policy.insert([key(i) for i in range(5)], list(range(5)))
    policy.touch([key(0), key(1), key(2), key(3), key(4)])
    # The fifth protected block pushes the least recent (the chain's tail, 4) to probation.
    assert list(policy._probation) == [key(4)]
    assert victims(policy, 1) == [key(4)]
    policy.insert([key(4)], [4])  # stored again soon after eviction: protected at once
    assert key(4) in policy._protected


@pytest.mark.parametrize("name", ["s3fifo", "sieve", "chain"])
def test_contract_holds_skip_all_or_nothing_and_clear(name):
    cls = get_policy_class(name)
    policy = filled(cls, 6)
    policy.touch([key(1)])
    policy.hold(key(0))
    policy.hold(key(1))
    assert policy.contains(key(0)) and policy.get(key(1)) == 1 and len(policy) == 6
    assert policy.evictable_blocks() == 4
    before = sorted(policy)
    assert policy.evict(4, {key(2)}) is None  # only 3 may go: nothing changes
    assert sorted(policy) == before
    assert policy.evict_unheld(5) is None
    out = victims(policy, 3, skip=[key(2)])
    assert set(out) == {key(3), key(4), key(5)}
    policy.release(key(0))
    assert policy.evictable_blocks() == 2
    assert policy.remove(key(1)) == 1 and policy.remove(key(1)) is None
    policy.touch([key(99)])  # unknown: ignored
    assert sorted(policy.clear()) == [(key(0), 0), (key(2), 2)]
    assert len(policy) == 0 and policy.evict(1, set()) is None
    policy.insert([key(7)], [3])
    assert policy.contains(key(7)) and victims(policy, 1) == [key(7)]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "sieve", "chain"])
def test_insert_held_is_insert_then_hold(name):
    """A block held from the moment it is ready (write-back: not saved below yet) is never a
    victim, and comes back to the order when released — as with insert, then hold."""
    cls = get_policy_class(name)
    policy = cls(8)
    keys = [key(i) for i in range(4)]
    policy.insert_held(keys, [0, 1, 2, 3], {key(1), key(3)})
    assert len(policy) == 4 and policy.get(key(3)) == 3 and policy.contains(key(1))
    assert policy.evictable_blocks() == 2
    assert policy.evict_unheld(3) is None
    assert sorted(victims(policy, 2)) == sorted([key(0), key(2)])
    policy.insert_held([key(5), key(6)], [5, 6], [key(5), key(6)])  # all held: a list will do
    assert policy.evictable_blocks() == 0 and policy.evict(1, set()) is None
    for k in (key(1), key(3), key(5), key(6)):
        policy.release(k)
    assert policy.evictable_blocks() == 4
    assert sorted(victims(policy, 4)) == sorted([key(1), key(3), key(5), key(6)])

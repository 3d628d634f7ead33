import pytest

from helpers import key
from kvtier.policies.lru import LRUPolicy


def filled(n: int) -> LRUPolicy:
    """Keys 0..n-1 stored one call each: key 0 the oldest."""
    policy = LRUPolicy(n)
    for i in range(n):
        policy.insert([key(i)], [i])
    return policy


def test_one_call_leaves_the_head_most_recent_so_the_tail_goes_first():
    policy = LRUPolicy(6)
    policy.insert([key(i) for i in range(6)], list(range(6)))  # one request's prefix
    assert [k for k, _ in policy.evict(3, set())] == [key(5), key(4), key(3)]
    policy.insert([key(i) for i in range(3, 6)], [3, 4, 5])  # another request's
    policy.touch([key(0), key(1), key(2)])  # the first prefix used again: head newest
    assert [k for k, _ in policy.evict(6, set())] == [key(i) for i in (5, 4, 3, 2, 1, 0)]


def test_evicts_least_recently_used_first():
    policy = filled(4)
    policy.touch([key(0), key(2)])
    victims = policy.evict(2, set())
    assert victims == [(key(1), 1), (key(3), 3)]
    assert list(policy) == [key(0), key(2)]


def test_evict_skips_and_is_all_or_nothing():
    policy = filled(3)
    assert policy.evict(1, {key(0)}) == [(key(1), 1)]
    before = list(policy)
    assert policy.evict(2, {key(0)}) is None
    assert list(policy) == before
    assert policy.evict(3, set()) is None
    assert list(policy) == before


def test_get_contains_remove_touch_unknown():
    policy = filled(2)
    assert policy.get(key(1)) == 1 and policy.contains(key(1))
    assert policy.get(key(9)) is None and not policy.contains(key(9))
    policy.touch([key(9)])  # unknown keys are ignored
    assert policy.remove(key(1)) == 1
    assert policy.remove(key(1)) is None
    assert len(policy) == 1


def test_clear_returns_everything_and_keeps_bound_methods_valid():
    policy = filled(3)
    assert sorted(policy.clear()) == sorted((key(i), i) for i in range(3))
    assert len(policy) == 0
    policy.insert([key(7)], [0])
    assert policy.contains(key(7))  # the bound C method still sees the same dict


@pytest.mark.parametrize("count", [0, 1, 3])
def test_evict_count(count):
    policy = filled(3)
    victims = policy.evict(count, set())
    assert victims is not None and len(victims) == count


def test_held_keys_stay_visible_are_never_victims_and_return_as_recent():
    policy = filled(4)
    policy.hold(key(0))
    policy.hold(key(1))
    assert policy.contains(key(0)) and policy.get(key(1)) == 1 and len(policy) == 4
    assert policy.evictable_blocks() == 2
    assert policy.evict(3, set()) is None  # only two may go: nothing changed
    assert policy.evict(1, set()) == [(key(2), 2)]  # the held, older keys were not visited
    assert policy.entries_visited == 1
    policy.release(key(0))
    assert policy.evict(2, set()) == [(key(3), 3), (key(0), 0)]  # released = just used
    assert policy.evict(1, set()) is None and policy.contains(key(1))
    assert policy.remove(key(1)) == 1 and len(policy) == 0

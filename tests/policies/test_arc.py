from helpers import key
from kvtier.policies.arc import ARCPolicy


def test_new_keys_land_in_t1_and_a_touch_promotes_to_t2():
    policy = ARCPolicy(4)
    policy.insert([key(0), key(1)], [0, 1])
    assert list(policy._t1) == [key(1), key(0)] and not policy._t2  # the head most recent
    policy.touch([key(0)])
    assert list(policy._t2) == [key(0)] and list(policy._t1) == [key(1)]
    policy.touch([key(0)])  # stays in t2, at the recent end
    assert list(policy._t2) == [key(0)]


def test_eviction_prefers_t1_while_above_target_and_remembers_ghosts():
    policy = ARCPolicy(4)
    policy.insert([key(i) for i in range(4)], [0, 1, 2, 3])
    policy.touch([key(0), key(1)])  # t1 = [3, 2], t2 = [1, 0], p = 0
    victims = policy.evict(1, set())
    assert victims == [(key(3), 3)]  # |t1| = 2 > p = 0: take t1's oldest (the tail)
    assert key(3) in policy._b1 and not policy.contains(key(3))


def test_ghost_hit_in_b1_grows_target_and_goes_to_t2():
    policy = ARCPolicy(4)
    policy.insert([key(i) for i in range(4)], [0, 1, 2, 3])
    policy.evict(2, set())  # the tail, keys 3 and 2, become b1 ghosts
    assert policy.target_t1_blocks == 0
    policy.insert([key(3)], [3])
    assert policy.target_t1_blocks >= 1
    assert key(3) in policy._t2 and key(3) not in policy._b1


def test_ghost_hit_in_b2_shrinks_target():
    policy = ARCPolicy(2)
    policy.insert([key(0), key(1)], [0, 1])
    policy.touch([key(0), key(1)])  # both frequent, t2 = [1, 0]
    policy.evict(1, set())  # t1 empty: from t2 -> b2 ghost of key 1
    assert key(1) in policy._b2
    policy._p = 1.0
    policy.insert([key(1)], [1])
    assert policy.target_t1_blocks == 0.0
    assert key(1) in policy._t2


def test_evict_skips_pinned_and_falls_back_to_the_other_list():
    policy = ARCPolicy(3)
    policy.insert([key(0), key(1), key(2)], [0, 1, 2])
    policy.touch([key(2)])  # t1 = {0, 1}, t2 = {2}
    victims = policy.evict(1, {key(0), key(1)})
    assert victims == [(key(2), 2)]
    assert policy.evict(3, set()) is None  # only 2 left
    assert len(policy) == 2


def test_ghost_lists_stay_bounded():
    capacity = 8
    policy = ARCPolicy(capacity)
    for i in range(200):
        if len(policy) == capacity:
            assert policy.evict(1, set()) is not None
        if not policy.contains(key(i % 37)):
            policy.insert([key(i % 37)], [i])
        if i % 3 == 0:
            policy.touch([key((i * 7) % 37)])
        sizes = len(policy._t1), len(policy._t2), len(policy._b1), len(policy._b2)
        assert sizes[0] + sizes[2] <= capacity
        assert sum(sizes) <= 2 * capacity


def test_clear_resets_history():
    policy = ARCPolicy(2)
    policy.insert([key(0), key(1)], [0, 1])
    policy.evict(1, set())  # the tail, key 1
    dropped = policy.clear()
    assert dropped == [(key(0), 0)]
    assert len(policy) == 0 and not policy._b1 and policy.target_t1_blocks == 0


def test_held_keys_keep_their_list_and_a_touch_while_held_promotes():
    policy = ARCPolicy(4)
    policy.insert([key(i) for i in range(4)], [0, 1, 2, 3])
    policy.touch([key(3)])  # t1 = {0, 1, 2}, t2 = {3}
    policy.hold(key(0))
    policy.hold(key(3))
    assert policy.contains(key(0)) and policy.get(key(3)) == 3 and len(policy) == 4
    assert policy.evictable_blocks() == 2
    policy.touch([key(0)])  # used again while held: belongs to t2 now
    assert policy.evict(3, set()) is None
    assert sorted(policy.evict(2, set())) == [(key(1), 1), (key(2), 2)]
    assert policy.evict(1, set()) is None  # everything left is held
    policy.release(key(0))
    policy.release(key(3))
    assert list(policy._t2) == [key(0), key(3)] and not policy._t1
    assert policy.remove(key(0)) == 0 and policy.remove(key(0)) is None


def test_eviction_without_a_skip_set_chooses_as_the_walk_does():
    """The counting fast path (nothing to pass over) and the walk (a skip set naming no ready
    key) must drop the same blocks, in the same order, through ghosts, holds and p moving."""
    import random

    rng = random.Random(7)
    fast, walk = ARCPolicy(64), ARCPolicy(64)
    absent = {key(10**6)}
    free = list(range(64))
    for _ in range(3000):
        op = rng.random()
        ready = list(fast)
        if op < 0.45 or not ready:
            n = rng.randint(1, 6)
            keys = [key(rng.randrange(300)) for _ in range(n)]
            keys = [k for k in dict.fromkeys(keys) if not fast.contains(k)]
            shortfall = len(keys) - len(free)
            if shortfall > 0:
                a, b = fast.evict_unheld(shortfall), walk.evict(shortfall, absent)
                assert a == b
                if a is None:
                    continue
                free.extend(block_id for _, block_id in a)
            ids = [free.pop() for _ in keys]
            fast.insert(keys, ids)
            walk.insert(keys, ids)
        elif op < 0.8:
            picked = rng.sample(ready, min(len(ready), 4))
            fast.touch(picked)
            walk.touch(picked)
        elif op < 0.9:
            k = rng.choice(ready)
            if k not in fast._held_t2 and (k in fast._t1 or k in fast._t2):
                fast.hold(k)
                walk.hold(k)
        else:
            held = [k for k in ready if k not in fast._t1 and k not in fast._t2]
            if held:
                k = rng.choice(held)
                fast.release(k)
                walk.release(k)
        assert list(fast._t1) == list(walk._t1) and list(fast._t2) == list(walk._t2)
        assert list(fast._b1) == list(walk._b1) and fast._p == walk._p
    assert fast.entries_visited == walk.entries_visited > 0

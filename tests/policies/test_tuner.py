"""The chain policy's learnt protected share: shadows, the race, and what it buys."""

import random

import pytest

from kvtier_testing import key
from kvtier.plan.simulate import simulate
from kvtier.policies.chain import SHARES, ChainPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.tuner import BATCH_SHARE, MAX_SAMPLE_SHIFT, MIN_SHADOW_BLOCKS, SettingTuner, Shadow


def test_shadow_counts_the_keys_it_holds_and_stores_the_rest_evicting_its_own_victims():
    shadow = Shadow(LRUPolicy(3))
    assert shadow.reference([key(1), key(2), key(3)]) == 0
    # 1 found; 4 stored, and 3 out: the tail of the first batch, the least recent
    assert shadow.reference([key(1), key(4)]) == 1
    policy = shadow.policy
    assert [policy.contains(key(i)) for i in (1, 2, 3, 4)] == [True, True, False, True]
    assert shadow.reference([key(5), key(6), key(7), key(8)]) == 0  # longer than the cache
    assert set(policy) == {key(5), key(6), key(7)}
    assert sorted(policy.get(k) for k in policy) == [0, 1, 2]  # slots reused, none lost


@pytest.mark.parametrize("capacity", [10, 200, 1_000, 10_000, 1_000_000])
def test_sampling_shrinks_shadows_to_no_less_than_the_floor_and_no_rarer_than_the_cap(capacity):
    tuner = SettingTuner(capacity, (0.0, 0.5), 0.0, lambda share, blocks: ChainPolicy(blocks, share), print)
    shift = tuner.sample_mask.bit_length()
    assert tuner.shadow_blocks == capacity >> shift
    assert shift <= MAX_SAMPLE_SHIFT
    # one more halving would go under the floor, unless the cap stopped it first
    assert shift == MAX_SAMPLE_SHIFT or capacity >> (shift + 1) < MIN_SHADOW_BLOCKS
    assert tuner.shadow_blocks >= min(capacity, MIN_SHADOW_BLOCKS)
    assert [shadow.policy.capacity_blocks for shadow in tuner.shadows] == [tuner.shadow_blocks] * 2
    assert [shadow.policy.protected_share for shadow in tuner.shadows] == [0.0, 0.5]
    # a batch is a small part of a shadow, so feeding one never flushes it
    assert BATCH_SHARE <= 1 / 8 and 1 <= tuner.batch_keys <= max(1, int(tuner.shadow_blocks * BATCH_SHARE))


def test_the_tuner_applies_whichever_setting_leads_and_counts_the_changes():
    """Two shadows of different sizes stand in for two settings: the bigger cache must win
    on a loop that only it holds whole, and the owner is told once."""
    told = []
    tuner = SettingTuner(64, (1.0, 2.0), 1.0, lambda size, blocks: LRUPolicy(int(size * 20)), told.append)
    assert tuner.sample_mask == 0 and tuner.batch_keys == int(64 * BATCH_SHARE)  # every key sampled
    loop = [key(i) for i in range(30)]
    for _ in range(20):
        tuner.observe(loop)
    assert told == [2.0] and tuner.setting == 2.0 and tuner.changes == 1
    assert tuner.shadows[1].score > tuner.shadows[0].score


def hot_prefixes_under_a_flood(seed=1):
    """40 prefixes of 16 blocks read again and again, each with a one-off question, and
    every fifth request a 300-block one-off document: LRU lets the flood wash the hot
    prefixes out; a large protected share keeps them."""
    rng = random.Random(seed)
    prefixes = [list(range(p * 16, p * 16 + 16)) for p in range(40)]
    fresh = 10_000
    chains = []
    for index in range(3_000):
        if index % 5 == 4:
            chains.append(list(range(fresh, fresh + 300)))
            fresh += 300
        else:
            chains.append(prefixes[rng.randrange(40)] + list(range(fresh, fresh + 8)))
            fresh += 8
    return chains


def conversations(seed=1):
    """30 conversations live at a time, taken in turn; each turn repeats the whole last
    prompt and adds 2 blocks, and after 4 turns a conversation ends for good and a new one
    (20 blocks) takes its place. A new prompt is reused as surely as a proven one, so
    proven blocks of ended conversations deserve no shelter: LRU order is right."""
    rng = random.Random(seed)
    fresh = 0

    def new_prompt():
        nonlocal fresh
        fresh += 20
        return list(range(fresh - 20, fresh))

    live = [[new_prompt(), rng.randrange(4)] for _ in range(30)]
    chains = []
    for index in range(6_000):
        slot = live[index % 30]
        if slot[1] == 4:
            slot[:] = [new_prompt(), 0]
        else:
            slot[0] = slot[0] + [fresh, fresh + 1]
            fresh += 2
            slot[1] += 1
        chains.append(list(slot[0]))
    return chains


@pytest.mark.parametrize("workload", [hot_prefixes_under_a_flood, conversations])
def test_the_learnt_share_hits_about_as_much_as_the_best_fixed_share(workload):
    chains = workload()
    capacity = 1_024
    fixed = {s: simulate(chains, ChainPolicy(capacity, s), capacity).hits for s in SHARES}
    best, worst = max(fixed.values()), min(fixed.values())
    assert best > 1.2 * worst  # the workload does separate the shares
    learnt_policy = ChainPolicy(capacity)
    learnt = simulate(chains, learnt_policy, capacity).hits
    # the race costs a little while it learns, and lands far from the worst share
    assert learnt >= 0.97 * best
    assert fixed[learnt_policy.protected_share] == best


def test_a_flood_drives_the_share_up_from_where_it_starts():
    policy = ChainPolicy(1_024)
    assert policy.protected_share == SHARES[0] == 0.0  # LRU order until shown otherwise
    simulate(hot_prefixes_under_a_flood(), policy, 1_024)
    assert policy.protected_share == max(SHARES) and policy.share_changes >= 1


def test_a_lowered_share_drains_protected_a_bounded_amount_per_call():
    policy = ChainPolicy(100, protected_share=0.9)
    policy.insert([key(i) for i in range(100)], list(range(100)))
    policy.touch([key(i) for i in range(100)])
    assert len(policy._protected) == 90
    policy._set_share(0.0)  # what the tuner does when the LRU-order copy leads
    policy.touch([key(0)])
    assert len(policy._protected) == 90 - (2 * 1 + 8)
    sizes = []
    while policy._protected:
        policy.touch([key(1)])
        sizes.append(len(policy._protected))
    assert all(a - b <= 10 for a, b in zip([80, *sizes], sizes))
    assert len(policy) == 100 and len(policy._probation) == 100  # nothing lost on the way


def test_a_fixed_share_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"protected_share must be in \[0, 1\), got 1.0"):
        ChainPolicy(10, protected_share=1.0)

"""The learnt chain policy against LRU on every trace kvtier has: the issue's "never more than
0.005 below LRU at any capacity", checked on traces of different shapes, not tuned to one."""

import pytest

from kvtier.plan.simulate import simulate
from kvtier.plan.synthetic import write_synthetic_trace
from kvtier.policies.chain import ChainPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.replay.trace import BUNDLED_TRACES, bundled_trace_path, load_trace

CAPACITIES = [500, 2_000, 5_000, 10_000, 20_000, 50_000]


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    built = write_synthetic_trace(tmp_path_factory.mktemp("syn") / "s.jsonl")
    paths = {name: bundled_trace_path(name) for name in BUNDLED_TRACES} | {"built": built}
    return {name: [r.hash_ids for r in load_trace(path)] for name, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("trace", [*BUNDLED_TRACES, "built"])
def test_learnt_chain_never_falls_below_lru_and_beats_it_where_there_is_room(chains, trace):
    gains = []
    for capacity in CAPACITIES:
        lru = simulate(chains[trace], LRUPolicy(capacity), capacity).hit_ratio
        learnt = simulate(chains[trace], ChainPolicy(capacity), capacity).hit_ratio
        assert learnt >= lru - 0.005, (trace, capacity, learnt, lru)
        gains.append(learnt - lru)
    assert max(gains) > 0.01, gains  # each trace has sizes where knowing prefixes pays


def test_a_fixed_share_is_what_the_learnt_one_guards_against(chains):
    """Why the share is learnt: the classic 0.8 split loses to LRU on the conversation
    trace (it keeps finished conversations' proven blocks and drops live ones' new
    blocks), while it wins on the synthetic one; the learnt share wins on both."""
    capacity = 20_000
    conversation = chains["conversation"]
    lru = simulate(conversation, LRUPolicy(capacity), capacity).hit_ratio
    fixed = simulate(conversation, ChainPolicy(capacity, 0.8), capacity).hit_ratio
    learnt_policy = ChainPolicy(capacity)
    learnt = simulate(conversation, learnt_policy, capacity).hit_ratio
    assert fixed < lru - 0.01 < learnt - 0.01
    assert learnt_policy.protected_share < 0.8
    synthetic = chains["synthetic"]
    capacity = 10_000
    lru = simulate(synthetic, LRUPolicy(capacity), capacity).hit_ratio
    learnt_policy = ChainPolicy(capacity)
    assert simulate(synthetic, learnt_policy, capacity).hit_ratio > lru + 0.01
    assert learnt_policy.protected_share > 0.0


def reused_once(requests=8_000, seed=1):
    """Each prompt (5-30 new blocks) comes back exactly once, 1-400 requests later, then never:
    a block that was hit is dead. The worst case for a segmented LRU, whose protected
    segment fills with the dead."""
    import random

    rng = random.Random(seed)
    chains, due, fresh = [], {}, 0
    for index in range(requests):
        if index in due:
            chains.append(due.pop(index))
            continue
        chain = list(range(fresh, fresh + rng.randint(5, 30)))
        fresh += len(chain)
        chains.append(chain)
        due.setdefault(index + rng.randint(1, 400), chain)
    return chains


@pytest.mark.parametrize("capacity", [2_000, 5_000])
def test_where_every_hit_block_is_dead_the_learnt_share_falls_back_to_lru_order(capacity):
    chains = reused_once()
    lru = simulate(chains, LRUPolicy(capacity), capacity).hit_ratio
    fixed = simulate(chains, ChainPolicy(capacity, 0.8), capacity).hit_ratio
    learnt_policy = ChainPolicy(capacity)
    learnt = simulate(chains, learnt_policy, capacity).hit_ratio
    assert fixed < lru / 2  # a fixed protected share keeps the dead
    assert learnt >= lru - 0.005 and learnt_policy.protected_share == 0.0

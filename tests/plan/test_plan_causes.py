"""kvtier plan counts each missed block reference as new, evicted or behind a miss: exactly."""

import io
import json

import pytest

from kvtier.plan.run import plan
from kvtier.plan.simulate import simulate
from kvtier.policies import get_policy_class, registered_policies
from kvtier.policies.lru import LRUPolicy
from kvtier.replay.trace import bundled_trace_path, load_trace


def test_a_request_coming_back_after_eviction_misses_as_evicted():
    # two blocks of room: the second request evicts the first's, which then come back
    result = simulate([(1, 2), (3, 4), (1, 2)], LRUPolicy(2), 2, causes=True)
    assert result.hits == 0
    assert result.misses == {"new": 4, "evicted": 2, "behind": 0}


def test_a_cached_block_after_a_miss_is_behind_it():
    # 2 is cached when request 3 comes, but 5 misses first: prefix matching computes 2 again
    result = simulate([(1, 2), (3,), (5, 2)], LRUPolicy(10), 10, causes=True)
    assert result.misses == {"new": 4, "evicted": 0, "behind": 1}
    assert result.refs - result.hits == 5


@pytest.mark.parametrize("name", registered_policies())
def test_the_causes_of_every_policy_sum_to_its_misses(name):
    chains = [request.hash_ids for request in load_trace(bundled_trace_path(), 400)]
    distinct = len({block for chain in chains for block in chain})
    for capacity in (64, 1024):
        result = simulate(chains, get_policy_class(name)(capacity), capacity, causes=True)
        assert result.misses is not None
        assert sum(result.misses.values()) == result.refs - result.hits
        # new: each block's first reference misses once (a request longer than the cache
        # stores only its head, so its tail may miss as new again)
        assert result.misses["new"] >= distinct


def test_plan_reports_misses_by_cause_per_size(tmp_path):
    trace = tmp_path / "t.jsonl"
    chains = [(1, 2), (3, 4), (1, 2)] * 5
    trace.write_text(
        "\n".join(
            json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": list(c)})
            for i, c in enumerate(chains)
        )
    )
    out = io.StringIO()
    record = plan(trace, [2, 4], ["lru"], block_bytes=1024, out=out)
    two, four = record["misses"]["lru"]
    # A B A, five times: with room for two blocks, every A after a B and every B after an A
    # misses as evicted (9 requests of 2 blocks), an A after an A hits; with four, all fit
    assert two == {"new": 4, "evicted": 18, "behind": 0}
    assert four == {"new": 4, "evicted": 0, "behind": 0}
    text = out.getvalue()
    assert "missed block refs by cause" in text
    header = text[text.index("missed block refs by cause") :].splitlines()[1]
    assert header.split() == ["blocks", "policy", "new", "evicted", "behind"]

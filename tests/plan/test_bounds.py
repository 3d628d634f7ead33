"""kvtier plan's bounds: the reuse oracle, oracle disk admission, and the reuse signals."""

import json

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.plan.admission import simulate_admission
from kvtier.plan.belady import belady
from kvtier.plan.oracle import last_reference, reuse_oracle
from kvtier.plan.run import plan
from kvtier.plan.signals import reuse_signals
from kvtier.plan.simulate import simulate
from kvtier.plan.synthetic import write_synthetic_trace
from kvtier.policies import get_policy_class, registered_policies
from kvtier.policies.admission import AdmissionFilter
from kvtier.replay.trace import bundled_trace_path, ceiling_hit_ratio, load_trace


def _chains(path):
    return [request.hash_ids for request in load_trace(path)]


def test_reuse_oracle_by_hand():
    # Capacity 2. Storing 3, then 4, needs a slot each; only 1, 2 come back (request 3).
    chains = [(1, 2), (3,), (4,), (1, 2)]
    chain = get_policy_class("chain")
    # chain drops its probation tail first: 2 for 3, then 1 for 4: the last request misses.
    assert simulate(chains, chain(2), 2).hits == 0
    assert simulate(chains, get_policy_class("lru")(2), 2).hits == 0
    # The oracle makes room for 3 the same way (nothing is dead yet: 1 and 2 come back), so 2
    # goes; before request 2, 3 is dead (never named again) and leaves instead of 1: 1 hits.
    assert reuse_oracle(chains, chain, 2).hits == 1
    # Belady also knows *when*: it never stores 3 or 4, and hits both 1 and 2.
    assert belady(chains, 2).hits == 2
    assert last_reference(chains) == {1: 3, 2: 3, 3: 1, 4: 2}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    synthetic = write_synthetic_trace(tmp_path_factory.mktemp("syn") / "s.jsonl", requests=3000)
    return {"bundled": (bundled_trace_path(), [2000, 10000]), "synthetic": (synthetic, [250, 1000])}


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["bundled", "synthetic"])
def test_reuse_oracle_between_every_policy_and_belady(traces, trace):
    path, capacities = traces[trace]
    record = plan(path, capacities)
    ceiling = record["ceiling"]
    for i, capacity in enumerate(capacities):
        bound = record["reuse_oracle"][i]
        policies = {name: ratios[i] for name, ratios in record["hit_ratio"].items()}
        assert set(policies) == set(registered_policies())
        assert bound >= max(policies.values()), (capacity, bound, policies)
        assert bound <= record["opt"][i] <= ceiling
        # Knowing which blocks come back is worth something at these sizes.
        assert bound > max(policies.values())
    # The planner's figure is the simulation's: one policy, told, recomputed here.
    name = record["reuse_oracle_policy"][0]
    told = reuse_oracle(_chains(path), get_policy_class(name), capacities[0])
    assert record["reuse_oracle"][0] == round(told.hit_ratio, 4)
    assert told.refs == record["block_refs"]


def test_admission_by_hand():
    # CPU tier of 1 block over an unbounded disk: 1, then 2, then 1 again.
    chains = [(1,), (2,), (1,)]
    lru = get_policy_class("lru")
    every = simulate_admission(chains, lru(1), 1)
    # 1 is written when 2 pushes it out, read back for request 2 (a hit), which pushes 2 out:
    # 2 is written too, though no request names it again — the write an oracle skips.
    assert (every.hits, every.writes, every.reads, every.needless_writes) == (1, 2, 1, 1)
    reuse = simulate_admission(chains, lru(1), 1, AdmissionFilter("reuse", 2))
    # Seen once when each leaves the CPU tier: both refused, so request 2 misses.
    assert (reuse.hits, reuse.writes, reuse.refused) == (0, 0, 2)


class _OracleAdmission:
    """Admits a block only if a later request names it: the oracle the planner's share means.
    It learns the current request from ``record``, called once per block of each request."""

    def __init__(self, chains):
        self._request_of_ref = [index for index, chain in enumerate(chains) for _ in chain]
        self._last = last_reference(chains)
        self._refs = 0

    def record(self, key):
        self._refs += 1

    def admit(self, key):
        return self._last[key] > self._request_of_ref[self._refs - 1]


@pytest.mark.parametrize("trace", ["bundled", "synthetic"])
def test_oracle_share_is_refused_at_no_hit_loss_and_reuse_loses(traces, trace):
    path, capacities = traces[trace]
    chains = _chains(path)
    lru = get_policy_class("lru")
    capacity = capacities[0]
    every = simulate_admission(chains, lru(capacity), capacity)
    ceiling, _ = ceiling_hit_ratio(load_trace(path))
    assert every.hit_ratio == pytest.approx(ceiling)  # the disk never evicts
    assert 0 < every.needless_writes < every.writes
    oracle = simulate_admission(chains, lru(capacity), capacity, _OracleAdmission(chains))
    assert oracle.hits == every.hits
    assert oracle.writes == every.writes - every.needless_writes
    reuse = simulate_admission(chains, lru(capacity), capacity, AdmissionFilter("reuse", 2))
    assert reuse.writes < every.writes and reuse.hits < every.hits


def test_signals_by_hand():
    # 1, 2, 3; then 1, 2 (a prefix hit) and a new 4; then a new 5. Only 1 and 2 come back.
    signals = reuse_signals([(1, 2, 3), (1, 2, 4), (5,)])
    assert signals["new"] == {"refs": 5, "p_again": 0.4}
    assert signals["seen_before"] == {"refs": 2, "p_again": 0.0}
    assert signals["new_last_block"] == {"refs": 3, "p_again": 0.0}
    assert signals["new_body_block"] == {"refs": 2, "p_again": 1.0}
    assert signals["new_after_prefix_hit"] == {"refs": 1, "p_again": 0.0}
    assert signals["new_without_prefix_hit"] == {"refs": 4, "p_again": 0.5}
    assert signals["all"] == {"refs": 7, "p_again": round(2 / 7, 3)}
    # 1 and 2 come back one request and three block references later
    assert signals["reuse_distance_median"] == {"requests": 1, "block_refs": 3}
    assert signals["first_reuse_distance_median"] == {"requests": 1, "block_refs": 3}
    # Blocks are stored at refs 0, 1, 2 (1, 2, 3), 5 (4) and 6 (5), of 7; 1 and 2 come back 3
    # refs later. Age 0-2: 4 blocks end the bucket inside the trace (not 5), none reused in it.
    # Age 2-4: 1, 2, 3 (4 would end past the trace); 1 and 2 reused: 2 of 3 in 2 refs.
    by_age = reuse_signals([(1, 2, 3), (1, 2, 4), (5,)], age_edges=(0, 2, 4))["first_reuse_by_age"]
    assert by_age == [
        {"age_refs": [0, 2], "blocks": 4, "p_per_1k_refs": 0.0},
        {"age_refs": [2, 4], "blocks": 3, "p_per_1k_refs": round(1000 * 2 / 3 / 2, 4)},
    ]
    # By request length: the 3-block requests bring 1, 2, 3 and 4 (1 and 2 come back), the
    # 1-block one brings 5 (never back); no other bucket has a new block.
    by_length = {
        tuple(row["request_blocks"]): (row["refs"], row["p_again"])
        for row in signals["new_by_request_blocks"]
    }
    assert by_length.pop((1, 1)) == (1, 0.0)
    assert by_length.pop((2, 3)) == (4, 0.5)
    assert set(by_length.values()) == {(0, None)} and (128, None) in by_length


def test_plan_json_has_the_bounds_and_keeps_its_keys(tmp_path, capsys):
    chains = [(1, 2, 3), (5,), (1, 2, 3), (6, 7), (1, 2, 8)] * 4
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": list(c)}
            )
            for i, c in enumerate(chains)
        )
    )
    assert (
        main(
            [
                "plan",
                str(trace),
                "--capacities",
                "3",
                "6",
                "--policies",
                "lru",
                "chain",
                "--signals",
                "--min-reuse",
                "3",
                "--json",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("capacities", "hit_ratio", "opt", "ceiling", "recommend", "refs_per_s"):
        assert key in record
    told = {
        name: [round(reuse_oracle(chains, get_policy_class(name), c).hit_ratio, 4) for c in (3, 6)]
        for name in ("lru", "chain")
    }
    assert record["reuse_oracle"] == [max(told["lru"][i], told["chain"][i]) for i in (0, 1)]
    assert [told[name][i] for i, name in enumerate(record["reuse_oracle_policy"])] == record["reuse_oracle"]
    admission = record["admission"]
    assert admission["min_reuse"] == 3 and admission["cpu_policy"] == "lru"
    every = simulate_admission(chains, get_policy_class("lru")(3), 3)
    assert admission["writes_all"][0] == every.writes
    assert admission["oracle_refusable"][0] == round(every.needless_writes / every.writes, 4)
    assert record["signals"] == reuse_signals(chains)
    assert "signals" not in plan(trace, [3], ["lru"])


def test_bad_admission_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--admission-policy"):
        plan(None, [10], ["lru"], admission_policy="mru")
    with pytest.raises(ConfigError, match="min_reuse"):
        plan(None, [10], ["lru"], min_reuse=0)

"""kvtier plan: the simulation drives the real policies; Belady bounds them; the CLI reports."""

import json

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.plan.belady import belady
from kvtier.plan.run import plan, smallest_reaching
from kvtier.plan.simulate import simulate
from kvtier.policies import get_policy_class, registered_policies
from kvtier.policies.chain import SHARES
from kvtier.policies.lru import LRUPolicy

# Two chains sharing a 2-block prefix, then a third request repeating the first.
CHAINS = [(1, 2, 3), (1, 2, 4), (1, 2, 3)]


def test_prefix_hits_count_only_the_leading_run():
    # Unbounded: request 2 hits 1, 2 (not 4); request 3 hits all of 1, 2, 3.
    result = simulate(CHAINS, LRUPolicy(10), 10)
    assert (result.hits, result.refs) == (5, 9)
    # A block after the first miss is no hit even if cached: 3 is cached, 9 is not.
    assert simulate([(1, 2, 3), (9, 2, 3)], LRUPolicy(10), 10).hits == 0


@pytest.mark.parametrize("name", registered_policies())
def test_every_policy_evicts_a_prefix_from_its_tail_and_keeps_its_head(name):
    chains = [(1, 2, 3), (5,), (1, 2, 3)]
    # Capacity 3: storing 5 evicts the tail 3 (evicting the head 1 instead would leave 2 and
    # 3 cached, serving nothing): the last request still hits 1, 2.
    assert simulate(chains, get_policy_class(name)(3), 3).hits == 2


def test_belady_bypasses_a_block_never_wanted_again():
    # Belady knows 5 never comes back: it bypasses 5 and hits all three.
    assert belady([(1, 2, 3), (5,), (1, 2, 3)], 3).hits == 3
    assert simulate(CHAINS, LRUPolicy(3), 3).hits == 4  # 1, 2 twice; 3 went for 4


@pytest.mark.parametrize("name", registered_policies())
def test_no_policy_beats_belady_or_the_ceiling(name):
    import random

    rng = random.Random(7)
    chains = []
    for _ in range(300):  # a few shared prefixes with random private tails
        prefix = rng.randrange(8)
        chains.append(
            tuple(range(prefix * 100, prefix * 100 + rng.randrange(1, 6)))
            + tuple(rng.randrange(10_000, 10_050) for _ in range(rng.randrange(4)))
        )
    cls = get_policy_class(name)
    for capacity in (4, 16, 64):
        ours = simulate(chains, cls(capacity), capacity)
        assert 0 < ours.hits <= belady(chains, capacity).hits
        assert ours.refs == sum(map(len, chains))


def test_smallest_reaching():
    assert smallest_reaching([10, 20, 40], [0.1, 0.5, 0.6], 0.5) == 20
    assert smallest_reaching([10, 20], [0.1, 0.2], 0.5) is None


def test_plan_record_and_cli_json_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": list(c)}
        for i, c in enumerate(CHAINS * 20)
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    plot = tmp_path / "p.png"
    assert (
        main(
            [
                "plan",
                str(trace),
                "--capacities",
                "3",
                "10",
                "--policies",
                "lru",
                "chain",
                "--block-bytes",
                "1024",
                "--target",
                "0.9",
                "--plot",
                str(plot),
                "--json",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["capacities"] == [3, 10] and set(record["hit_ratio"]) == {"lru", "chain"}
    direct = plan(trace, [3, 10], ["lru", "chain"], target=0.9, block_bytes=1024)
    assert record["hit_ratio"] == direct["hit_ratio"] and record["opt"] == direct["opt"]
    # Unbounded, only the first sight of each of the four blocks misses.
    assert record["ceiling"] == pytest.approx((3 * 60 - 4) / (3 * 60), abs=1e-4)  # 1, 2, 3, 4 once
    assert record["hit_ratio"]["lru"][1] == pytest.approx(record["ceiling"], abs=1e-4)
    assert record["recommend"]["disk_blocks"] == 10 and record["recommend"]["disk_bytes"] == 10 * 1024
    assert plot.stat().st_size > 0
    # what chain learnt at each size is reported; LRU learns nothing and is not listed
    assert set(record["learnt"]) == {"chain"} and len(record["learnt"]["chain"]) == 2
    assert all(state["protected_share"] in SHARES for state in record["learnt"]["chain"])


def test_worker_processes_give_the_same_record(tmp_path):
    # Every simulation run in two spawned workers (policies found again there by class path,
    # a policy named by its path too) instead of here: only the timings and `jobs` differ.
    trace = tmp_path / "t.jsonl"
    chains = [(1, 2, 3), (5,), (1, 2, 3), (6, 7), (1, 2, 8)] * 6
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": list(c)}
            )
            for i, c in enumerate(chains)
        )
    )
    names = ["lru", "chain", "kvtier.policies.arc:ARCPolicy"]
    here = plan(trace, [2, 4, 8], names, admission_policy="chain", jobs=1)
    apart = plan(trace, [2, 4, 8], names, admission_policy="chain", jobs=2)
    timings = {"refs_per_s", "opt_refs_per_s", "wall_s", "jobs"}
    assert {k: v for k, v in here.items() if k not in timings} == {
        k: v for k, v in apart.items() if k not in timings
    }
    assert (here["jobs"], apart["jobs"]) == (1, 2)
    assert set(apart["refs_per_s"]) == set(names) and all(v > 0 for v in apart["refs_per_s"].values())
    assert set(apart["learnt"]) == {"chain", names[2]}  # what the workers' policies learnt came back


def test_bad_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--jobs"):
        plan(None, [10], ["lru"], jobs=0)
    with pytest.raises(ConfigError, match="--policies"):
        plan(None, [10], ["mru"])
    with pytest.raises(ConfigError, match="--capacities"):
        plan(None, [0], ["lru"])
    with pytest.raises(ConfigError, match="--target"):
        plan(None, [10], ["lru"], target=1.5)


def test_synthetic_trace_is_deterministic_and_loads(tmp_path):
    from kvtier.plan.synthetic import write_synthetic_trace
    from kvtier.replay.trace import ceiling_hit_ratio, load_trace

    first = write_synthetic_trace(tmp_path / "a.jsonl", requests=300, seed=3).read_text()
    assert write_synthetic_trace(tmp_path / "b.jsonl", requests=300, seed=3).read_text() == first
    requests = load_trace(tmp_path / "a.jsonl")
    assert len(requests) == 300
    ratio, refs = ceiling_hit_ratio(requests)
    assert 0 < ratio < 1 and refs == sum(len(r.hash_ids) for r in requests)

"""``admit: budget`` in a replay, on the trace's time: the goal of bench_write_budget.py on a
shorter trace (its first 1,500 requests, 406 s of trace time)."""

import pytest

from kvtier.bench.write_budget import compare_write_budget


@pytest.fixture(scope="module")
def record():
    return compare_write_budget(limit=1500, window_s=120)


def test_a_budget_of_half_the_unthrottled_rate_is_written_within_ten_percent(record):
    full, reuse, half, matched, _ = record["runs"]
    assert [run["run"] for run in record["runs"]] == [
        "all",
        "reuse",
        "budget",
        "budget_matched",
        "reuse_same_bytes",
    ]
    assert 0.9 <= record["budget_share"] <= 1.1
    assert half["bytes_written"] < full["bytes_written"]
    # the budget bites: some blocks seen once are refused, not all
    assert half["stats"]["refused_blocks"] > 0 and half["admit_threshold"] > 1
    assert half["hit_ratio"] <= full["hit_ratio"]
    # over any span of a window, at most the budget plus a bucket (a window's budget)
    budget = half["budget_bytes_per_s"]
    assert half["peak_bytes_per_s"] <= 2 * budget
    # a budget at min_reuse 2's rate writes about what min_reuse 2 wrote (the bank aside)
    assert matched["bytes_written"] == pytest.approx(reuse["bytes_written"], rel=0.2)


def test_a_fractional_min_reuse_is_found_that_writes_the_budgets_bytes(record):
    full, reuse, half, _, same = record["runs"]
    # between min_reuse 1 (every block) and 2, the bar that writes what the budget wrote
    assert 1 < same["min_reuse"] < 2
    assert same["bytes_written"] == pytest.approx(half["bytes_written"], rel=0.03)
    assert record["same_bytes_share"] == pytest.approx(1, abs=0.03)
    # between the two bars it lies between, in bytes and in hits
    assert reuse["bytes_written"] < same["bytes_written"] < full["bytes_written"]
    assert reuse["hit_ratio"] < same["hit_ratio"] < full["hit_ratio"]
    # a fixed bar has no bound: writes follow the trace's bursts
    assert same["stats"]["refused_blocks"] > 0 and "budget_bytes_per_s" not in same["stats"]


def test_every_loaded_block_was_verified(record):
    assert all(run["mismatched_blocks"] == 0 for run in record["runs"])


def test_the_budget_figures_are_reported_in_trace_time(record):
    half = record["runs"][2]
    stats = half["stats"]
    budget = 0.5 * record["runs"][0]["bytes_written"] / record["span_s"]
    assert stats["budget_bytes_per_s"] == pytest.approx(budget)
    # replay counts the tier's own writes (the drive's counter runs on wall time)
    assert stats["device_written_bytes"] >= half["bytes_written"]
    assert 0 < stats["write_bytes_per_s"] < 3 * budget
    assert stats["projected_life_years"] > 0


def test_the_same_bytes_search_stays_between_its_bars():
    from kvtier.bench.write_budget import SAME_BYTES, _same_bytes

    def bytes_at(bar):  # convex in the bar, as the trace's bytes are: regula falsi needs steps
        return int(600e6 / bar**1.5)

    tried = []

    def run(bar):
        tried.append(bar)
        return {"run": "fixed", "min_reuse": bar, "bytes_written": bytes_at(bar)}

    low = {"run": "all", "min_reuse": 1, "bytes_written": bytes_at(1)}
    high = {"run": "reuse", "min_reuse": 2, "bytes_written": bytes_at(2)}
    found = _same_bytes(run, 400_000_000, low, high)
    assert found["run"] == "reuse_same_bytes" and 1 < found["min_reuse"] < 2
    assert found["bytes_written"] == pytest.approx(400e6, rel=SAME_BYTES)
    assert all(1 < bar < 2 for bar in tried)
    # a target outside the bracket: no bar outside it is tried, the nearer end is the answer
    tried.clear()
    above = _same_bytes(run, 700_000_000, low, high)
    below = _same_bytes(run, 100_000_000, low, high)
    assert tried == []
    assert (above["min_reuse"], above["run"]) == (1, "reuse_same_bytes")
    assert (below["min_reuse"], below["run"]) == (2, "reuse_same_bytes")

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
    assert record["same_bytes_share"] == same["bytes_written"] / half["bytes_written"]
    assert reuse["hit_ratio"] < same["hit_ratio"] < full["hit_ratio"]
    assert record["hit_ratio_over_same_bytes"] == half["hit_ratio"] - same["hit_ratio"]
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

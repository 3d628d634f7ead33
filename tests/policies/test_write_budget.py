"""The write-budget controller of ``admit: budget``, on a clock the tests move."""

import math
import zlib

import pytest

from kvtier_testing import key
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.write_budget import DITHER_S, MAX_ESTIMATE, SECONDS_PER_YEAR, WriteBudget

BLOCK = 16 * 1024


def key_draw(key: bytes) -> float:
    """A draw in [0, 1) fixed by ``key`` (its CRC-32): blocks spread over the margin, the
    same way every run, for driving the controller directly."""
    return zlib.crc32(key) / 2**32


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def drive(budget, clock, seconds, per_second, estimate_of, start=0):
    """Offer ``per_second`` blocks each simulated second (estimates from ``estimate_of(i)``),
    telling the budget what it admitted as written; the admitted blocks' indices."""
    admitted = []
    i = start
    for _ in range(seconds):
        clock.now += 1
        for _ in range(per_second):
            if budget.admit(estimate_of(i), key_draw(key(i)), BLOCK):
                admitted.append(i)
                budget.wrote(BLOCK)
            i += 1
        budget.tick()
    return admitted


def test_writes_stay_within_the_budget_when_demand_is_twice_it():
    clock = Clock()
    rate = 10 * BLOCK  # bytes per second
    budget = WriteBudget(rate, window_s=60, clock=clock)
    # 20 blocks a second, a third seen twice: twice the budget
    admitted = drive(budget, clock, 1200, 20, lambda i: 2 if i % 3 == 0 else 1)
    written = len(admitted) * BLOCK
    assert written == pytest.approx(rate * 1200, rel=0.05)
    assert 1 < budget.threshold < 2  # every block seen twice, part of those seen once
    assert budget.stats()["write_bytes_per_s"] == pytest.approx(rate, rel=0.1)


def test_the_bucket_bounds_every_span():
    clock = Clock()
    rate = 10 * BLOCK
    budget = WriteBudget(rate, window_s=30, clock=clock)
    per_second = []
    for second in range(600):
        burst = 200 if second % 100 < 10 else 2  # bursts of 20x the budget
        per_second.append(len(drive(budget, clock, 1, burst, lambda i: 5, start=second * 1000)))
    # no span writes more than its budget plus the bucket (window_s seconds of budget)
    for width in (1, 10, 60, 300):
        most = max(sum(per_second[s : s + width]) for s in range(len(per_second) - width))
        assert most * BLOCK <= rate * width + budget.capacity_bytes


def test_the_threshold_sends_the_budget_to_reused_blocks():
    clock = Clock()
    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock)
    # half the offers seen once, half four times; the budget takes half of all
    admitted = drive(budget, clock, 900, 20, lambda i: 4 if i % 2 else 1)
    later = [i for i in admitted if i >= 20 * 300]  # past the start's five windows
    reused = sum(1 for i in later if i % 2)
    assert reused / len(later) > 0.95
    assert 1.5 < budget.threshold <= 5  # all seen 4 times, next to none of those seen once


def test_blocks_at_the_margin_offered_together_pass_or_fail_together():
    # A prefix's blocks are written about the same time: at a fractional threshold they must
    # share one decision, or the refused ones scattered through it cut every prefix short.
    clock = Clock()
    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock)
    outcomes = set()
    for second in range(900):
        clock.now += 1
        assert budget.phase() == pytest.approx(clock.now / DITHER_S % 1.0)
        # 20 blocks a second, the first 5 seen twice, then 15 seen once: twice the budget
        taken = [budget.admit(2 if i < 5 else 1, budget.phase(), BLOCK) for i in range(20)]
        for ok in taken:
            if ok:
                budget.wrote(BLOCK)
        budget.tick()
        once = taken[5:]
        # once refused, no later block of the same second passes (the bucket or the threshold)
        assert once == sorted(once, reverse=True)
        if second >= 300:
            outcomes.add(any(once))
    assert 1 < budget.threshold < 2
    assert outcomes == {True, False}  # seen-once blocks pass in some spells, not in others


def test_demand_under_the_budget_is_all_admitted():
    clock = Clock()
    budget = WriteBudget(100 * BLOCK, window_s=60, clock=clock)
    admitted = drive(budget, clock, 300, 20, lambda i: 1)
    assert len(admitted) == 300 * 20
    assert budget.threshold == 1.0


def test_the_threshold_follows_a_change_in_demand():
    clock = Clock()
    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock)
    drive(budget, clock, 600, 5, lambda i: 1)  # quiet: under budget
    assert budget.threshold == 1.0
    busy = drive(budget, clock, 1200, 40, lambda i: 1 + i % 4, start=10**6)  # four times it
    assert budget.threshold > 2
    assert len(busy) * BLOCK == pytest.approx(10 * BLOCK * 1200, rel=0.1)
    drive(budget, clock, 900, 5, lambda i: 1, start=10**7)  # quiet again
    assert budget.threshold == 1.0


def test_the_drives_other_writes_count_against_the_budget():
    clock = Clock()
    device = {"bytes": 10**9}
    rate = 10 * BLOCK
    budget = WriteBudget(rate, window_s=60, clock=clock, device_written=lambda: device["bytes"])
    assert budget.counts_device
    admitted = 0
    for second in range(600):
        clock.now += 1
        device["bytes"] += 4 * BLOCK  # another writer: 40% of the budget
        for i in range(20):
            if budget.admit(1, key_draw(key(second * 100 + i)), BLOCK):
                admitted += 1
                budget.wrote(BLOCK)
                device["bytes"] += BLOCK
        budget.tick()
    assert admitted * BLOCK == pytest.approx(0.6 * rate * 600, rel=0.1)
    assert budget.written_bytes() == device["bytes"] - 10**9
    assert budget.stats()["device_written_bytes"] == budget.written_bytes()


def test_a_device_count_lagging_the_tiers_is_not_taken_twice():
    clock = Clock()
    device = {"bytes": 0}
    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock, device_written=lambda: device["bytes"])
    flushed = 0
    for second in range(600):
        clock.now += 1
        for i in range(20):
            if budget.admit(1, key_draw(key(second * 100 + i)), BLOCK):
                budget.wrote(BLOCK)
        if second % 30 == 29:  # the page cache reaches the drive every 30 s
            flushed = budget._own_bytes
        device["bytes"] = flushed
        budget.tick()
    assert budget._own_bytes == pytest.approx(10 * BLOCK * 600, rel=0.1)


def test_the_drive_is_read_at_most_once_a_second():
    clock = Clock()
    reads = []

    def device():
        reads.append(clock.now)
        return 4096 * len(reads)

    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock, device_written=device)
    for _ in range(100):
        clock.now += 0.1
        budget.tick()
    assert len(reads) == 1 + 10  # the base, then one a second
    assert budget.written_bytes() == 4096 * 10


def test_projected_life_is_the_endurance_over_the_rate_seen():
    clock = Clock()
    rate = 1e6
    budget = WriteBudget(rate, window_s=60, endurance_bytes=600e12, clock=clock)
    assert "projected_life_years" not in budget.stats()  # nothing written yet
    for _ in range(600):
        clock.now += 1
        budget.wrote(int(rate))
        budget.tick()
    stats = budget.stats()
    assert set(stats) == {
        "budget_bytes_per_s",
        "write_bytes_per_s",
        "admit_threshold",
        "projected_life_years",
        "device_written_bytes",
    }
    assert stats["write_bytes_per_s"] == pytest.approx(rate, rel=1e-3)
    assert stats["projected_life_years"] == pytest.approx(600e12 / rate / SECONDS_PER_YEAR, rel=1e-3)


def test_use_clock_restarts_on_the_new_time_and_can_drop_the_device():
    clock, trace = Clock(), Clock()
    trace.now = 5.0
    budget = WriteBudget(10 * BLOCK, window_s=60, clock=clock, device_written=lambda: 123)
    budget.use_clock(trace, count_device=False)
    assert not budget.counts_device
    budget.wrote(BLOCK)
    assert budget.written_bytes() == BLOCK  # the tier's own count now
    trace.now += 1000  # a long quiet span: the bucket is full, not more
    admitted = sum(budget.admit(1, 0.5, BLOCK) for _ in range(2000))
    assert admitted * BLOCK <= budget.capacity_bytes + BLOCK


def test_admission_filter_budget_mode_counts_and_uses_the_budget():
    clock = Clock()
    budget = WriteBudget(BLOCK, window_s=10, clock=clock)  # a bucket of 10 blocks, 5 in it
    admission = AdmissionFilter("budget", sketch_width=1 << 12, budget=budget, block_bytes=BLOCK)
    assert admission.counts_sightings
    for i in range(100):
        admission.record(key(i))
    taken = [admission.admit(key(i)) for i in range(100)]
    assert sum(taken) == 5 and admission.admitted == 5 and admission.refused == 95
    with pytest.raises(ValueError):
        AdmissionFilter("reuse", budget=budget)
    with pytest.raises(ValueError):
        AdmissionFilter("budget")


def test_key_draw_is_fixed_per_key_and_spread():
    draws = [key_draw(key(i)) for i in range(4000)]
    assert draws == [key_draw(key(i)) for i in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert sum(d < 0.25 for d in draws) == pytest.approx(1000, rel=0.1)


def test_estimates_above_the_histogram_count_as_its_top():
    clock = Clock()
    budget = WriteBudget(BLOCK, window_s=10, clock=clock)
    assert budget.admit(10 * MAX_ESTIMATE, 0.0, BLOCK)
    assert not math.isnan(budget.threshold)


def test_a_budget_needs_a_positive_rate_and_window():
    with pytest.raises(ValueError):
        WriteBudget(0, 60)
    with pytest.raises(ValueError):
        WriteBudget(1.0, 0)

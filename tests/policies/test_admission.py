"""The lower-tier admission filter and its count-min sketch."""

import numpy as np
import pytest

from kvtier_testing import key
from kvtier.errors import ConfigError
from kvtier.policies.admission import AdmissionFilter, CountMinSketch


def test_sketch_counts_exactly_without_collisions_and_never_undercounts():
    sketch = CountMinSketch(1 << 12)
    for i in range(50):
        for _ in range(i % 4):
            sketch.add(key(i))
    # Never below the truth; with 50 keys in 4096 counters per row, almost always exact.
    estimates = [sketch.estimate(key(i)) for i in range(50)]
    assert all(est >= i % 4 for i, est in enumerate(estimates))
    assert sum(est == i % 4 for i, est in enumerate(estimates)) >= 48


def test_sketch_is_bounded_and_halves_after_ten_times_its_width():
    sketch = CountMinSketch(16)
    assert sketch.width == 16
    for _ in range(9):
        sketch.add("hot")
    assert sketch.estimate("hot") >= 9
    for i in range(10 * 16 - 10):
        sketch.add(("other", i))
    before, total = sketch.estimate("hot"), sum(sketch._rows[0])
    assert total == 10 * 16 - 1  # no reset yet: every addition is in each row
    sketch.add("trigger")  # the 160th addition: every counter is halved
    assert sketch.estimate("hot") <= (before + 1) // 2
    assert sum(sketch._rows[0]) <= (total + 1) // 2
    assert all(len(row) == 16 for row in sketch._rows)


def test_reuse_mode_refuses_one_off_blocks_and_admits_at_min_reuse():
    admission = AdmissionFilter("reuse", min_reuse=2, sketch_width=1 << 12)
    admission.record(key(1))
    assert admission.admit(key(1)) is False  # seen once
    admission.record(key(1))
    assert admission.admit(key(1)) is True  # seen twice
    assert admission.admit(key(2)) is False  # never seen
    assert (admission.admitted, admission.refused) == (1, 2)


def test_fractional_min_reuse_admits_blocks_seen_once_for_its_share_of_each_minute():
    now = [0.0]
    admission = AdmissionFilter("reuse", min_reuse=1.75, sketch_width=1 << 12, clock=lambda: now[0])
    admission.record(key(1))  # seen once
    admission.record(key(2))
    admission.record(key(2))  # seen twice
    once, twice = [], []
    for second in range(120):  # two draw cycles (DITHER_S = 60), a block offered each second
        now[0] = second + 0.5
        once.append(admission.admit(key(1)))
        twice.append(admission.admit(key(2)))
    assert all(twice)  # at or above the bar's next whole number: always
    # seen once: 1 + draw >= 1.75 for the last quarter of each minute, in one spell
    assert once == [second % 60 >= 45 for second in range(120)]
    assert admission.admit(key(3)) is False  # never seen: 0 + draw < 1.75


@pytest.mark.parametrize("bar", [3, 3.0, np.int64(3)])
def test_whole_min_reuse_never_reads_the_clock(bar):
    def clock() -> float:
        raise AssertionError("an integral bar needs no draw")

    admission = AdmissionFilter("reuse", min_reuse=bar, sketch_width=1 << 12, clock=clock)
    for _ in range(2):
        admission.record(key(1))
    assert admission.admit(key(1)) is False
    admission.record(key(1))
    assert admission.admit(key(1)) is True


def test_all_mode_admits_everything():
    admission = AdmissionFilter("all")
    assert all(admission.admit(key(i)) for i in range(5))
    assert (admission.admitted, admission.refused) == (5, 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "some"}, "admit"),
        ({"min_reuse": 0}, "min_reuse"),
        ({"min_reuse": 0.5}, "min_reuse"),
        ({"min_reuse": float("nan")}, "min_reuse"),
        ({"min_reuse": 256}, "min_reuse"),
        ({"min_reuse": "2"}, "min_reuse"),
        ({"min_reuse": True}, "min_reuse"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AdmissionFilter(**kwargs)

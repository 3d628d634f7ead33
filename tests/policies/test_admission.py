"""The lower-tier admission filter and its count-min sketch."""

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


def test_all_mode_admits_everything():
    admission = AdmissionFilter("all")
    assert all(admission.admit(key(i)) for i in range(5))
    assert (admission.admitted, admission.refused) == (5, 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"mode": "some"}, "admit"), ({"min_reuse": 0}, "min_reuse"), ({"min_reuse": True}, "min_reuse")],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AdmissionFilter(**kwargs)

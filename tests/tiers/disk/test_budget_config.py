"""``admit: budget`` in a disk tier's section: its keys, their errors, and the stack it builds."""

import numpy as np
import pytest

from kvtier import build_manager, load_config
from kvtier.base import ReqContext, make_offload_key
from kvtier.errors import ConfigError
from kvtier.tiers.base import TierJob
from kvtier.policies.write_budget import SECONDS_PER_YEAR
from kvtier.tiers.disk.config import DEFAULT_LIFE_YEARS

BLOCK = 64 * 1024


def config(tmp_path, **disk):
    return {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": "4MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "lmdb", "path": str(tmp_path / "store"), "capacity": "16MiB", **disk},
        ]
    }


def error(tmp_path, **disk):
    with pytest.raises(ConfigError) as caught:
        load_config(config(tmp_path, **disk))
    return caught.value


def test_a_budget_needs_drive_writes_or_life_and_endurance(tmp_path):
    e = error(tmp_path, admit="budget")
    assert e.field == "tiers[1].admit"
    assert "drive_writes_per_day" in str(e) and "target_life_years" in str(e)
    e = error(tmp_path, admit="budget", target_life_years=5)
    assert e.field == "tiers[1].admit" and "no endurance_tbw" in str(e)
    e = error(tmp_path, admit="budget", endurance_tbw=600)
    assert "no target_life_years" in str(e)


@pytest.mark.parametrize(
    "key, value",
    [
        ("drive_writes_per_day", -1),
        ("drive_writes_per_day", 0),
        ("drive_writes_per_day", True),
        ("drive_writes_per_day", "1"),
        ("target_life_years", -5),
        ("budget_window_s", 0),
        ("drive_bytes", -1),
        ("drive_bytes", "2T"),
    ],
)
def test_bad_numbers_are_named(tmp_path, key, value):
    disk = {"admit": "budget", "drive_writes_per_day": 1, key: value}
    e = error(tmp_path, **disk)
    assert e.field == f"tiers[1].{key}" and e.value == value and e.fix


def test_budget_keys_without_admit_budget_are_refused(tmp_path):
    e = error(tmp_path, admit="reuse", drive_writes_per_day=1)
    assert e.field == "tiers[1].drive_writes_per_day"
    assert "admit: budget" in e.fix


def test_drive_writes_that_outrun_the_endurance_are_refused(tmp_path):
    # 1 TB at 3 writes a day is 5,479 TB in 5 years, against 600 TBW
    e = error(
        tmp_path,
        admit="budget",
        drive_writes_per_day=3,
        drive_bytes="1TB",
        target_life_years=5,
        endurance_tbw=600,
    )
    assert e.field == "tiers[1].drive_writes_per_day"
    assert "lower drive_writes_per_day to 0.329" in e.fix
    # consistent figures are taken
    parsed = load_config(
        config(
            tmp_path,
            admit="budget",
            drive_writes_per_day=0.3,
            drive_bytes="1TB",
            target_life_years=5,
            endurance_tbw=600,
        )
    )
    disk = parsed.tiers[1]
    assert (disk.admit, disk.drive_writes_per_day, disk.drive_bytes) == ("budget", 0.3, 10**12)


def test_a_contradiction_found_only_with_the_filesystems_size_fails_the_build(tmp_path):
    # no drive_bytes: the filesystem's size decides, when the tier opens
    cfg = config(tmp_path, admit="budget", drive_writes_per_day=1000, target_life_years=5, endurance_tbw=1)
    with pytest.raises(ConfigError) as caught:
        build_manager(cfg, BLOCK)
    assert caught.value.field == "tiers[1].drive_writes_per_day"


def make(i):
    return make_offload_key(i.to_bytes(32, "little"), 0)


def test_a_budget_stack_reports_its_figures_and_serves_what_it_wrote(tmp_path):
    manager = build_manager(
        config(tmp_path, admit="budget", drive_writes_per_day=0.5, drive_bytes="2TB"), BLOCK
    )
    try:
        budget = manager._admission[0].budget
        assert budget.budget_bytes_per_s == pytest.approx(0.5 * 2e12 / 86400)
        assert budget.endurance_bytes == pytest.approx(
            budget.budget_bytes_per_s * DEFAULT_LIFE_YEARS * SECONDS_PER_YEAR
        )
        ctx = ReqContext("r")
        keys = [make(i) for i in range(8)]
        out = manager.prepare_store(keys, ctx)
        payload = np.random.default_rng(1).integers(0, 256, (len(keys), BLOCK), dtype=np.uint8)
        rows = manager._backend.rows
        for i, row in enumerate(out.store_spec.block_ids):
            rows[row][:BLOCK] = payload[i]
        manager.complete_store(keys, ctx)
        manager.flush()  # everything to the disk: the half bucket holds hours of budget
        stats = manager.stats()
        for name in (
            "budget_bytes_per_s",
            "write_bytes_per_s",
            "admit_threshold",
            "device_written_bytes",
        ):
            assert f"nvme.{name}" in stats
        assert stats["nvme.admitted_blocks"] == len(keys)
        assert stats["nvme.demoted_bytes"] == len(keys) * BLOCK
        # read back from the disk into other CPU rows, byte for byte
        tier = manager.tiers[0]
        spare = manager._backend.allocate_block_ids(len(keys))
        tier.submit_load(TierJob(job_id=10**6, keys=tuple(keys), rows=tuple(spare)))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.success
        for i, row in enumerate(spare):
            assert bytes(rows[row][:BLOCK]) == payload[i].tobytes()
    finally:
        manager.shutdown()


@pytest.mark.parametrize("value", [0.5, 0, 300, "1.5", True, float("inf")])
def test_a_min_reuse_below_one_or_not_a_number_is_named(tmp_path, value):
    e = error(tmp_path, admit="reuse", min_reuse=value)
    assert e.field == "tiers[1].min_reuse" and "fractional allowed" in str(e)


@pytest.mark.parametrize("second, written", [(15.0, 0), (45.0, 8)])
def test_a_fractional_min_reuse_draws_by_the_clock_the_stack_is_given(tmp_path, second, written):
    # min_reuse 1.5: blocks seen once are written in the second half of each minute of the
    # clock (1 + draw >= 1.5); use_clock (as replay does) hands the filter that clock
    manager = build_manager(config(tmp_path, admit="reuse", min_reuse=1.5), BLOCK)
    try:
        manager.use_clock(lambda: second)
        ctx = ReqContext("r")
        keys = [make(i) for i in range(8)]
        out = manager.prepare_store(keys, ctx)
        rows = manager._backend.rows
        for i, row in enumerate(out.store_spec.block_ids):
            rows[row][:BLOCK] = i
        manager.complete_store(keys, ctx)
        manager.flush()
        stats = manager.stats()
        assert stats["nvme.admitted_blocks"] == written
        assert stats["nvme.refused_blocks"] == len(keys) - written
        assert stats["nvme.demoted_bytes"] == written * BLOCK
    finally:
        manager.shutdown()

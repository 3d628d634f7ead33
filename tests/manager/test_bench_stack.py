"""``kvtier bench manager --stack`` runs its protocol and reports every figure (not its speed)."""

import io

import pytest

from kvtier.bench import manager_stack
from kvtier.cli.main import main


@pytest.mark.slow
def test_stack_bench_record_has_every_figure():
    out = io.StringIO()
    record = manager_stack.run(sizes=(3000, 1000), steps=20, runs=2, out=out)
    assert set(record["us_per_step"]) == {"1000", "3000"}
    assert record["growth"] == record["us_per_step"]["3000"] / record["us_per_step"]["1000"]
    for size, per_step in record["us_per_step"].items():
        assert per_step > 0
        assert record["us_per_block"][size] == per_step / manager_stack.KEYS_PER_STEP
    assert 0 < record["bytes_per_block"] < 1000 and record["bytes_per_block_at"] == 3000
    assert record["protocol"]["write_policy"] == "write_back"
    assert set(record["floor_us_per_step"]) == {"1000", "3000"}
    assert record["floor_growth"] == record["floor_us_per_step"]["3000"] / record["floor_us_per_step"]["1000"]
    if record["baseline"] == "vllm":
        assert set(record["vllm_us_per_step"]) == {"1000", "3000"}
    lines = out.getvalue().splitlines()
    # the table and the growth; the JSON line is the CLI's, with --json only
    assert lines[-1].startswith("growth 3000/1000") and not any(line.startswith("{") for line in lines)


def test_kvtier_driver_reaches_the_steady_state_and_every_lookup_hits():
    driver = manager_stack._KvtierDriver(2000)
    try:
        driver.fill()
        driver.check_steady()
        evictions = driver.manager.stats()["evictions"]
        lower = driver.lower.stats()
        assert lower["blocks"] + 2 * manager_stack.STORES >= 2000  # full from the start
        for _ in range(10):
            driver.step()  # raises if a store is refused or a recent block misses
        stats = driver.manager.stats()
        assert stats["ready_blocks"] == 2000 and stats["evictions"] == evictions + 10 * manager_stack.STORES
        # every block saved below pushes one filler (or older) block out of the full lower tier
        after = driver.lower.stats()
        stored, evicted = after["stored"] - lower["stored"], after["evicted"] - lower["evicted"]
        assert stored >= 10 * manager_stack.STORES and evicted == stored
        assert stats["lookups"] == stats["cpu_hits"] > 0
    finally:
        driver.close()


def test_floor_driver_evicts_its_oldest_and_every_lookup_hits():
    driver = manager_stack._FloorDriver(1000)
    driver.fill()
    driver.check_steady()
    oldest = next(iter(driver.index))
    driver.step()  # raises if a recent block misses
    assert len(driver.index) == 1000 and oldest not in driver.index
    assert driver.evictions == (manager_stack.LOOKBACK_STEPS + 9) * manager_stack.STORES


def test_cli_rejects_bad_sizes(capsys):
    assert main(["bench", "manager", "--stack", "--sizes", "10k,20k"]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_cli_rejects_a_tier_too_small_for_the_protocol(capsys):
    assert main(["bench", "manager", "--stack", "--sizes", "0,10000"]) == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and str(manager_stack.MIN_SIZE) in err and "Traceback" not in err

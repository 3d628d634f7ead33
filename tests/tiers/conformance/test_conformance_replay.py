"""The conformance scenarios through ``kvtier replay``, for every harnessed lower-tier kind.

A replay runs the bundled trace's first requests through the real stack (a CPU tier of 300
blocks above the kind's tier) and verifies every block loaded into the simulated GPU cache;
its JSON record must show 0 mismatched blocks whatever happened to the lower tier. A kind's
tier is damaged between a cold replay and a warm one (which finds the cold one's blocks
below), or its server is down for the warm one.
"""

from __future__ import annotations

import io

import pytest

import kvtier
from kvtier.replay.run import replay
from kvtier.tiers.cpu.region import row_stride_for

#: the first requests of the bundled trace: enough reuse that a 300-block CPU tier sends
#: about half of the warm replay's hits to the tier below
LIMIT = 150
BLOCK_BYTES = 4096
REPLAY = {
    "limit": LIMIT,
    "gpu_blocks": 400,
    "block_bytes": BLOCK_BYTES,
    "baseline": False,
    "progress": False,
    "deterministic": True,
}


def configure(harness, scenario: str) -> dict:
    harness.place(scenario)
    return {
        "tiers": [
            {
                "name": "cpu",
                "kind": "cpu",
                "capacity": 300 * row_stride_for(BLOCK_BYTES),
                "pin_memory": "off",
            },
            {"name": "far", **harness.section(4096, BLOCK_BYTES)},
        ],
    }


def run(config: dict, **options) -> dict:
    """One replay; its JSON record, checked for what must hold whatever the tier did."""
    record = replay(config=config, out=io.StringIO(), **{**REPLAY, **options})
    assert record["requests"] == LIMIT
    assert record["mismatched_blocks"] == 0  # every loaded block compared, none wrong
    assert record["failed_transfers"] == 0
    assert record["verified_blocks"] == sum(record["hits"][tier] for tier in ("cpu", "far"))
    return record


def test_replay_round_trip(harness):
    record = run(configure(harness, "round trip"))
    assert record["demotions"] > 0 and record["promotions"] > 0
    assert record["hits"]["far"] > 0 and record["corrupt_blocks"] == 0


@pytest.mark.parametrize("scenario", ["missing", "corrupt"])
def test_replay_with_blocks_damaged_between_runs(harness, scenario):
    config = configure(harness, scenario)
    if not harness.persistent:
        harness.cannot(f"{scenario} between replays", "nothing it holds outlives the first replay")
    cold = run(config)
    assert cold["demotions"] > 0
    reference = run(config)  # warm, nothing damaged: what the tier below serves
    assert reference["hits"]["far"] > 0 and reference["corrupt_blocks"] == 0

    manager = kvtier.build_manager(config, BLOCK_BYTES)  # open it as the replay does
    try:
        tier = manager.tiers[0]
        listed = harness.listed(tier)
        assert len(listed) >= reference["hits"]["far"] // 2
        damaged = listed[::2]
        getattr(harness, "remove" if scenario == "missing" else "corrupt")(tier, damaged)
    finally:
        manager.shutdown()

    warm = run(config)
    assert 0 < warm["hits"]["far"] < reference["hits"]["far"]
    if scenario == "corrupt":  # read, failed verification, counted, recomputed
        assert 0 < warm["corrupt_blocks"] <= len(damaged)
    else:  # simply not there any more
        assert warm["corrupt_blocks"] == 0


def test_replay_with_the_server_down(harness):
    config = configure(harness, "replay down")
    cold = run(config)
    assert cold["demotions"] > 0
    harness.go_down(None)
    # the tier opens in an outage: misses, recomputed, never a stall; the stack does what the
    # CPU tier alone does (the baseline replayed beside it)
    warm = run(config, baseline=True)
    assert warm["hits"]["far"] == 0 and warm["promotions"] == 0 and warm["demotions"] == 0
    assert warm["hit_ratio"] == warm["cpu_only_hit_ratio"]

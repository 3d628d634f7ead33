"""The replay engine waits like an engine's queue: a request that fits the GPU cache on its own
never fails mid-run, and a request waiting on a lower tier blocks instead of stepping empty."""

import io

import pytest
from kvtier_testing.valkey_tier import local_server

from kvtier.replay.engine import ReplayEngine
from kvtier.replay.run import replay
from kvtier.replay.trace import Request
from kvtier.spec import TieredOffloadingSpec
from kvtier.tiers.cpu.region import row_stride_for

BLOCK = 4096


def cpu_spec(tmp_path, cpu_blocks: int) -> TieredOffloadingSpec:
    config = {
        "block_size_tokens": 512,
        "tiers": [
            {
                "kind": "cpu",
                "capacity": cpu_blocks * BLOCK,
                "path": str(tmp_path / "cpu-region"),
                "pin_memory": "off",
            }
        ],
    }
    return TieredOffloadingSpec(config, gpu_block_size_tokens=512, page_bytes=[BLOCK])


def gpu_blocks_accounted(engine: ReplayEngine) -> int:
    """Free, cached, or waiting for a copy to end: every GPU block is exactly one of these."""
    return len(engine._free_gpu) + len(engine._gpu_cache) + len(engine._orphans)


def test_cached_blocks_past_the_prefix_are_recomputed_without_leaking_gpu_blocks(tmp_path):
    # The second request's blocks 2 and 3 sit in the GPU cache, but its prefix breaks at 9:
    # they are computed again. Holding them for the request (and leaking their old blocks
    # when the new ones replaced them) made a 3-block cache fail here.
    engine = ReplayEngine(cpu_spec(tmp_path, 64), gpu_blocks=3)
    requests = [
        Request(0, 0, 0, (1, 2, 3)),
        Request(1, 0, 0, (9, 2, 3)),
        Request(2, 0, 0, (1, 2, 3)),
        *(Request(3 + i, 0, 0, (9, 2, 3 + i)) for i in range(20)),
    ]
    try:
        engine.run(requests)
        assert gpu_blocks_accounted(engine) == 3
    finally:
        engine.close()
    counts = engine.counts
    assert counts.requests == len(requests) and counts.mismatched_blocks == 0
    assert counts.verified_blocks == counts.hits["cpu"] > 0
    assert not engine._orphans and not engine._copying


def test_bundled_trace_replays_whole_with_a_small_gpu_cache(tmp_path):
    # Issue #21: "a request needs 149 GPU blocks but only 146 are free of 300", mid-run
    cpu = {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": 2000 * row_stride_for(BLOCK), "pin_memory": "off"}],
    }
    record = replay(None, cpu, gpu_blocks=300, block_bytes=BLOCK, progress=False, out=io.StringIO())
    assert record["requests"] + record["skipped_requests"] == 3993
    assert record["skipped_requests"] == 9  # the requests of more than 300 blocks, said up front
    assert record["mismatched_blocks"] == 0 and record["verified_blocks"] > 0


@pytest.fixture
def valkey_url():
    with local_server() as server:
        yield server.url


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_replay_over_valkey_waits_for_its_answers_instead_of_stepping(valkey_url, deterministic):
    # Before: every lookup the server had not answered yet was an empty step, then another:
    # 814 steps per request on this slice. Now a request blocks on the tier's reads.
    config = {
        "block_size_tokens": 512,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 1000 * row_stride_for(BLOCK), "pin_memory": "off"},
            {"name": "shared", "kind": "valkey", "url": valkey_url, "timeout_s": 5.0},
        ],
    }
    record = replay(
        "conversation",
        config,
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=300,
        baseline=False,
        progress=False,
        out=io.StringIO(),
        deterministic=deterministic,
    )
    assert record["requests"] == 300 and record["mismatched_blocks"] == 0
    assert record["hits"]["shared"] > 0  # blocks came back from the server, verified
    assert record["steps"] <= 8 * record["requests"]


@pytest.mark.slow
def test_a_fleet_leaves_out_requests_larger_than_the_gpu_cache_up_front(
    valkey_url, tmp_path, monkeypatch, capsys
):
    from kvtier.replay.fleet import replay_fleet

    monkeypatch.chdir(tmp_path)
    record = replay_fleet(
        None,
        engines=2,
        valkey_url=valkey_url,
        gpu_blocks=100,
        block_bytes=BLOCK,
        limit=130,
        out=io.StringIO(),
    )
    # requests 12, 93 and 122 of the bundled trace have more than 100 blocks
    assert record["skipped_requests"] == 3 and record["requests"] == 127
    assert record["mismatched_blocks"] == 0
    assert "skipping 3 of 130 requests" in capsys.readouterr().err

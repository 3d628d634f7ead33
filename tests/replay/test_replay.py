import json

import numpy as np
import pytest

from kvtier.config import CascadeConfig
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.replay.engine import ReplayEngine, block_bytes_of, block_key
from kvtier.replay.run import replay
from kvtier.replay.trace import Request, bundled_trace_path, load_trace
from kvtier.spec import TieredOffloadingSpec
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.cpu.backend import CPUBackend

BLOCK = 4096


def cpu_config(blocks: int) -> dict:
    return {"block_size_tokens": 512, "tiers": [{"kind": "cpu", "capacity": blocks * BLOCK, "pin_memory": "off"}]}


def test_block_bytes_are_distinct_per_key():
    a, b = block_bytes_of(block_key(1), BLOCK), block_bytes_of(block_key(2), BLOCK)
    assert a.shape == (BLOCK,) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, block_bytes_of(block_key(1), BLOCK))


def test_cpu_only_replay_of_a_trace_slice_verifies_every_load(tmp_path, capsys):
    record = replay(
        str(bundled_trace_path()),
        json.dumps(cpu_config(3000)),
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=300,
        progress=False,
    )
    assert record["requests"] == 300 and record["mismatched_blocks"] == 0
    assert record["hits"]["cpu"] > 0 and record["verified_blocks"] == record["hits"]["cpu"]
    assert record["hit_ratio"] <= record["ceiling_hit_ratio"] + 1e-9
    # every reference is a hit of some tier or computed again
    assert sum(record["hits"].values()) + record["computed_blocks"] == record["block_refs"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(record))


def stack_engine(tmp_path, cpu_blocks: int, store_blocks: int, gpu_blocks: int):
    spec = TieredOffloadingSpec(
        {"block_size_tokens": 512, "tiers": [{"kind": "cpu", "capacity": cpu_blocks * BLOCK,
                                              "path": str(tmp_path / "cpu-region"), "pin_memory": "off"}]},
        gpu_block_size_tokens=512,
        page_bytes=[BLOCK],
    )
    backend = CPUBackend(cpu_blocks, BLOCK, path=spec.region_path, pin_memory="off")
    store = MemoryTier("mem", backend.rows, store_blocks)
    spec._manager = TierStackManager(
        backend, LRUPolicy(cpu_blocks), [store], CascadeConfig(write_policy="write_through")
    )
    return ReplayEngine(spec, gpu_blocks), store


def test_stack_replay_promotes_from_below_and_serves_right_bytes(tmp_path):
    engine, store = stack_engine(tmp_path, cpu_blocks=8, store_blocks=100, gpu_blocks=4)
    shared = Request(0, 0, 0, (1, 2, 3, 4))
    others = [Request(i, 0, 0, tuple(range(10 * i, 10 * i + 4))) for i in range(1, 4)]
    requests = [shared, *others, shared]  # 12 other blocks push the shared ones out of the CPU tier
    try:
        engine.run(requests)
    finally:
        engine.close()
    counts = engine.counts
    assert counts.mismatched_blocks == 0
    assert counts.hits["mem"] > 0  # blocks 1-4 left the GPU and the CPU tier, came back from below
    assert counts.verified_blocks == counts.hits["cpu"] + counts.hits["mem"]
    assert counts.dropped_blocks == 0


def test_stack_replay_with_rotting_store_is_a_miss_not_wrong_bytes(tmp_path):
    engine, store = stack_engine(tmp_path, cpu_blocks=4, store_blocks=100, gpu_blocks=4)
    first = [Request(i, 0, 0, tuple(range(4 * i + 1, 4 * i + 5))) for i in range(4)]
    try:
        engine.run(first)
        for hash_id in (1, 2, 3, 4):
            if store.lookup(block_key(hash_id)):
                store.corrupt(block_key(hash_id))
        engine.run([Request(3, 0, 0, (1, 2, 3, 4))])
    finally:
        engine.close()
    assert engine.counts.mismatched_blocks == 0
    assert engine.manager.stats()["mem.corrupt_blocks"] >= 1
    assert engine.counts.hits["mem"] == 0  # every rotten block was a miss, then recomputed


def test_replay_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "hits.png"
    replay(
        str(bundled_trace_path()), json.dumps(cpu_config(1000)), gpu_blocks=400, block_bytes=BLOCK,
        limit=100, progress=False, plot=str(target),
    )
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_replay_default_stack_on_a_slice(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--limit", "150", "--no-progress", "--json", "--block-bytes", "4096"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tiers"] == ["cpu:cpu", "disk:lmdb"]
    assert record["mismatched_blocks"] == 0 and record["dropped_blocks"] == 0
    assert 0 < record["hit_ratio"] <= record["ceiling_hit_ratio"] + 1e-9
    assert "cpu_only_hit_ratio" in record

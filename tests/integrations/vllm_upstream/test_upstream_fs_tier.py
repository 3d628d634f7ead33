"""vLLM's fs tier tests (``FileSystemTierManager``), ported to kvtier's disk tier as vLLM's
tiering sees it: ``KvtierDiskTier``, a ``SecondaryTierManager``, over real files (kind
``files``) and a real LMDB store (kind ``lmdb``).

Jobs, lookups and the primary view are vLLM's; the data written by a store must come back
byte for byte. kvtier's tier answers lookups from its index in memory, so where vLLM's test
waits for an asynchronous lookup round, the port asks once. What differs on purpose is in
README.md beside this file.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_support import corrupt_block, offloading_config, tiering_extra

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import KvtierDiskTier

NUM_BLOCKS = 8
ROW_BYTES = 8192
CTX = ReqContext(req_id="test")
KINDS = ["files", "lmdb"]


def key(n: int):
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(job_id, keys, chunk_ids=None, is_promotion=False) -> TransferJob:
    if chunk_ids is None:
        chunk_ids = list(range(len(keys)))
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=is_promotion,
        req_context=CTX,
    )


def drain(tier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def spec(events: bool = False):
    """What vLLM hands a secondary tier: the offloading config and its events settings."""
    config = offloading_config(tiering_extra({}), events=events)
    return SimpleNamespace(
        config=config,
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=events, self_describing_kv_events=False
        ),
    )


def open_tier(path, rows: np.ndarray, kind: str, events: bool = False) -> KvtierDiskTier:
    return SecondaryTierFactory.create_secondary_tier(
        {
            "type": "KvtierDiskTier",
            "module_path": "kvtier.integrations.vllm",
            "kind": kind,
            "path": str(path),
            "capacity": "4MiB",
        },
        memoryview(rows),
        spec(events),
    )


@pytest.fixture(params=KINDS)
def fs_tier(request, tmp_path):
    rows = np.zeros((NUM_BLOCKS, ROW_BYTES), dtype=np.uint8)
    tier = open_tier(tmp_path / "store", rows, request.param)
    yield tier, rows
    tier.shutdown()


def random_rows(rows: np.ndarray, seed: int = 0) -> None:
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)


def test_lookup_empty_tier(fs_tier):
    tier, _ = fs_tier
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.MISS] * 2


def test_store_then_lookup_succeeds(fs_tier):
    """vLLM also checks the block's file path; kvtier names its files its own way, and lmdb
    has none (README: on-disk layout). The tier's count and its check() say it is there."""
    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.lookup(key(1), CTX) is LookupResult.HIT
    assert tier.tier.num_blocks() == 1
    report = tier.tier.check()
    assert report.healthy and report.blocks_checked == 1


def test_store_then_load_roundtrip(fs_tier):
    tier, rows = fs_tier
    random_rows(rows)
    expected = rows[:2].copy()
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.HIT] * 2
    tier.submit_load(make_job(2, [key(1), key(2)], [2, 3], is_promotion=True))
    assert all(r.success for r in drain(tier))
    np.testing.assert_array_equal(rows[2:4], expected)
    # blocks stay on disk after a load
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.HIT] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_path_raises_at_construction(kind):
    """vLLM raises OSError; kvtier raises ConfigError naming the entry's field (README)."""
    rows = np.zeros((4, ROW_BYTES), dtype=np.uint8)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[KvtierDiskTier\]"):
        open_tier("/dev/null/invalid_path", rows, kind)


def test_failed_load_missing_file(fs_tier):
    tier, _ = fs_tier
    tier.submit_load(make_job(1, [key(99)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success


def test_multiple_jobs_tracked_independently(fs_tier):
    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(tier)} == {1, 2}
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.HIT] * 2


def test_multi_block_job_partial_failure(fs_tier):
    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(10), key(11)], [0, 1]))
    assert all(r.success for r in drain(tier))
    tier.submit_load(make_job(2, [key(10), key(11), key(99)], [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].job_id == 2 and not results[0].success
    # kvtier also says which blocks loaded, verified (vLLM's test does not look)
    assert set(results[0].successful_keys) == {key(10), key(11)}


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
def test_store_load_data_integrity(fs_tier, batch_size):
    tier, rows = fs_tier
    random_rows(rows, batch_size)
    keys = [key(i) for i in range(batch_size)]
    load_ids = list(range(NUM_BLOCKS - batch_size, NUM_BLOCKS))
    expected = rows[:batch_size].copy()
    tier.submit_store(make_job(1, keys, list(range(batch_size))))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.tier.num_blocks() == batch_size
    rows[:] = 0  # what comes back must come from disk
    tier.submit_load(make_job(2, keys, load_ids, is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    for i, row in enumerate(load_ids):
        np.testing.assert_array_equal(rows[row], expected[i], err_msg=f"row {row}")


def test_failed_load_of_a_damaged_block_removes_it(fs_tier, tmp_path):
    """vLLM truncates the block's file; kvtier's blocks carry a checksum, so one flipped
    byte is damage enough. The load fails, the block is dropped, every lookup misses."""
    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    tier.submit_load(make_job(2, [key(1)], [0], is_promotion=True))
    assert all(r.success for r in drain(tier))  # a good load leaves it in place
    assert tier.lookup(key(1), CTX) is LookupResult.HIT
    corrupt_block(str(tmp_path / "store"), ROW_BYTES, key(1))
    tier.submit_load(make_job(3, [key(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tier.lookup(key(1), CTX) is LookupResult.MISS
    assert tier.lookup(key(1), ReqContext(req_id="fresh")) is LookupResult.MISS
    assert tier.tier.num_blocks() == 0


@pytest.mark.parametrize("bad", [0, 2], ids=["first", "last"])
def test_batched_partial_load_failure_keeps_loaded_blocks(fs_tier, tmp_path, bad):
    """vLLM stops a batch at its first bad block, so a bad first block loads nothing
    (successful_keys None); kvtier verifies each block apart and keeps every good one
    (README: partial loads)."""
    tier, rows = fs_tier
    random_rows(rows, 7)
    keys = [key(1), key(2), key(3)]
    expected = rows[:3].copy()
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    corrupt_block(str(tmp_path / "store"), ROW_BYTES, keys[bad])
    rows[:] = 0
    tier.submit_load(make_job(2, keys, [3, 4, 5], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    good = [k for i, k in enumerate(keys) if i != bad]
    assert tuple(results[0].successful_keys) == tuple(good)
    answers = [tier.lookup(k, CTX) for k in keys]
    assert answers == [LookupResult.MISS if i == bad else LookupResult.HIT for i in range(3)]
    for i in range(3):
        if i != bad:
            np.testing.assert_array_equal(rows[3 + i], expected[i])

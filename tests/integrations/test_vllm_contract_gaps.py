"""Where kvtier's full stack used to part from vLLM 0.33's contract, driven by vLLM's own code:
a request's ``kv_load_tiers``, a failed store's event under self-describing KV events, and a
replicated (MLA) layout shared by engines of different TP sizes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from types import SimpleNamespace as Namespace

import test_vllm_connector as connector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    KV_LOAD_TIERS_KEY,
    _create_req_context,
)
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_support import (
    STEP_END,
    drain_disk,
    key,
    kvtier_extra,
    offloading_config,
    run_steps_until,
)

from kvtier.testing import MemoryTier


def stack(tmp_path, **options):
    """kvtier's full stack (CPU over one LMDB disk named nvme) as vLLM's factory builds it."""
    tiers = [
        {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
        {
            "name": "nvme",
            "kind": "lmdb",
            "path": str(tmp_path / "nvme"),
            "capacity": "8MiB",
        },
    ]
    spec = OffloadingSpecFactory.create_spec(offloading_config(kvtier_extra(tiers), **options))
    return spec.get_manager()


def request_context(req_id: str, load_tiers=None):
    """The ReqContext vLLM's connector makes for a request with these kv_transfer_params."""
    params = None if load_tiers is None else {KV_LOAD_TIERS_KEY: load_tiers}
    return _create_req_context(Namespace(request_id=req_id, kv_transfer_params=params, kv_hints=None))


def store_then_forget_cpu(manager, keys) -> None:
    """Blocks saved to disk and gone from the CPU tier: only a promotion can serve them."""
    ctx = request_context("writer")
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    manager.inner.flush()
    manager.reset_cache()
    manager.on_reset_flushed()


@pytest.mark.parametrize(
    "load_tiers",
    [
        [],
        [{"medium": "cpu"}],
        [{"locality": "remote"}],
        [{"medium": "storage", "locality": "remote"}],
    ],
    ids=["no-tier", "cpu-only", "remote-only", "remote-storage"],
)
def test_a_request_kept_off_the_disk_misses_and_starts_no_promotion(tmp_path, load_tiers):
    manager = stack(tmp_path)
    try:
        keys = [key(i) for i in range(3)]
        store_then_forget_cpu(manager, keys)
        ctx = request_context("limited", load_tiers)
        manager.on_new_request(ctx)
        for _ in range(3):  # asked again step after step, it stays a miss and reads nothing
            assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
            manager.on_schedule_end(STEP_END)
            drain_disk(manager)
        figures = manager.stats()
        assert figures["nvme.promote_jobs"] == 0 and figures["nvme.queued_promotions"] == 0
        # each of the 9 misses is the request's filter's: the disk holds the block
        assert figures["misses"] == figures["miss_filtered"] == figures["nvme.miss_filtered"] == 9
        manager.on_request_finished(ctx)
        free = request_context("free")  # the blocks are there for a request that may read them
        manager.on_new_request(free)
        assert run_steps_until(manager, keys, free) == [LookupResult.HIT] * 3
        manager.on_request_finished(free)
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "load_tiers",
    [
        None,
        [{"medium": "storage"}],
        [{"locality": "local"}],
        [{"medium": "cpu"}, {"medium": "storage"}],
    ],
    ids=["unset", "storage", "local", "cpu-and-storage"],
)
def test_a_request_allowed_the_disk_is_promoted_from_it(tmp_path, load_tiers):
    manager = stack(tmp_path)
    try:
        keys = [key(i) for i in range(3)]
        store_then_forget_cpu(manager, keys)
        ctx = request_context("allowed", load_tiers)
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
        assert run_steps_until(manager, keys, ctx) == [LookupResult.HIT] * 3
        assert {manager.get_load_source(k, ctx) for k in keys} == {CacheHitSource.DISK}
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


def test_the_cpu_tier_serves_a_request_limited_to_no_tier(tmp_path):
    """vLLM's tiering filters its secondary tiers only; the CPU tier (its primary) answers."""
    manager = stack(tmp_path)
    try:
        ctx = request_context("limited", [])
        out = manager.prepare_store([key(1)], ctx)
        manager.complete_store(out.keys_to_store, ctx)
        assert manager.lookup(key(1), ctx) is LookupResult.HIT
    finally:
        manager.shutdown()


def test_a_remote_tier_is_told_from_a_disk_by_locality():
    """A tier that says it is remote (Valkey) is vLLM's REMOTE locality, a disk LOCAL."""

    class FarTier(MemoryTier):
        remote = True

    from kvtier.integrations.vllm import KvtierOffloadingManager
    from kvtier.manager.stack import TierStackManager
    from kvtier.policies.lru import LRUPolicy
    from kvtier.testing import MemoryBackend

    backend = MemoryBackend(4, 64)
    near, far = MemoryTier("near", backend.rows, 8), FarTier("far", backend.rows, 8)
    inner = TierStackManager(backend, LRUPolicy(4), [near, far])
    manager = KvtierOffloadingManager(inner, events=False, config_info={}, stats_log_interval_s=0)
    local = manager._load_tiers(request_context("a", [{"locality": "local"}]).load_tier_filter)
    remote = manager._load_tiers(request_context("b", [{"locality": "remote"}]).load_tier_filter)
    assert (local.names, remote.names) == ({"near"}, {"far"})


def test_a_failed_store_leaves_no_event_state_in_vllms_connector(tmp_path, monkeypatch):
    """With self-describing KV events, vLLM's connector keeps each stored chunk's event payload
    from the moment it asks for the store until a removal event for it; a failed store's
    metadata_only removal is that event, and no BlockRemoved is published for it."""
    plain = connector.vllm_config

    def with_events(*args, **kwargs):
        config = plain(*args, **kwargs)
        config.kv_events_config = Namespace(enable_kv_cache_events=True)
        return config

    monkeypatch.setattr(connector, "vllm_config", with_events)
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "self_describing_kv_events": True,
        "tiers": [{"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"}],
    }
    engine = connector.EngineLoop(extra, "kvtier-events-failure", tp_size=2)
    tracker = engine.scheduler._events_tracker
    assert tracker.self_describing_enabled
    try:
        broken = engine.workers[1].worker
        broken._started()
        copy_engine = broken._store.engine
        original = copy_engine.copy

        def fail_once(*descriptors):
            copy_engine.copy = original
            raise OSError("injected DMA failure")

        copy_engine.copy = fail_once
        assert engine.serve("first", connector.prompt(5, 3)) == 0  # its store fails on rank 1
        published = list(engine.scheduler.take_events())
        assert published == []  # never stored, so nothing to announce or retract
        assert tracker._pending_event_metadata == {}  # no entry for a block that does not exist
        assert engine.serve("second", connector.prompt(5, 3)) == 0  # stored this time
        published = list(engine.scheduler.take_events())
        assert [type(e).__name__ for e in published] == ["BlockStored"] * 3
        assert len(tracker._pending_event_metadata) == 3
        assert engine.serve("third", connector.prompt(5, 3)) == 3 * connector.BLOCK_TOKENS
    finally:
        engine.shutdown()


def test_a_failed_store_event_is_metadata_only_and_dropped_once_retried(tmp_path):
    manager = stack(tmp_path, events=True)
    try:
        ctx = request_context("r")
        for k in (key(1), key(2)):
            manager.prepare_store([k], ctx)
            manager.complete_store([k], ctx, success=False)
        manager.prepare_store([key(2)], ctx)  # stored again before the events are taken
        events = list(manager.take_events())
        assert [(e.keys, e.medium, e.removed, e.metadata_only) for e in events] == [
            ([key(1)], Medium.CPU, True, True)
        ]  # key 2's retraction would drop the state of its new store: left out
        manager.complete_store([key(2)], ctx)
        assert [(e.keys, e.removed) for e in manager.take_events()] == [([key(2)], False)]
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("mla", "hit_chunks"),
    [(True, 5), (False, 0)],
    ids=["mla-replicated", "per-rank-heads"],
)
def test_blocks_stored_at_tp2_are_read_at_tp4_when_every_rank_holds_the_same(tmp_path, mla, hit_chunks):
    """A replicated (MLA) row is the same bytes at any TP size, so its fingerprint names none;
    rows of per-rank heads differ with the TP size and stay apart."""
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {
                "name": "nvme",
                "kind": "files",
                "path": str(tmp_path / "store"),
                "capacity": "8MiB",
            },
        ],
    }
    tp2 = connector.EngineLoop(extra, f"kvtier-tp2-{mla}", tp_size=2, mla=mla)
    try:
        assert tp2.serve("before", connector.prompt(4, 5)) == 0
    finally:
        tp2.shutdown()  # saves the CPU tier's rows to disk
    tp4 = connector.EngineLoop(extra, f"kvtier-tp4-{mla}", tp_size=4, mla=mla)
    try:
        assert tp4.serve("after", connector.prompt(4, 5)) == hit_chunks * connector.BLOCK_TOKENS
        if hit_chunks:
            # every one of the 4 ranks got the bytes rank 0 of the TP=2 engine wrote
            assert tp4.sources == {CacheHitSource.DISK: hit_chunks * connector.BLOCK_TOKENS}
        else:
            # the TP=4 open wiped the TP=2 store; the miss says why: the parallel layout
            # (vLLM's fingerprint keeps rank 0 and writes tp= into its model string)
            figures = tp4.manager.stats()
            assert figures["miss_foreign"] == figures["foreign_tp"] >= 1
            assert figures["miss_new"] == 0
    finally:
        tp4.shutdown()


@pytest.mark.parametrize("success", [True, False])
def test_a_block_being_stored_is_hit_pending_until_its_store_ends(tmp_path, success):
    """0.33's contract (and its CPU manager): found but not readable yet is HIT_PENDING, so
    the request waits a step for the block instead of computing it again."""
    manager = stack(tmp_path)
    try:
        writer, reader = request_context("writer"), request_context("reader")
        manager.on_new_request(reader)
        out = manager.prepare_store([key(1)], writer)
        assert out.keys_to_store == [key(1)]
        assert manager.lookup(key(1), reader) is LookupResult.HIT_PENDING
        manager.on_schedule_end(STEP_END)
        assert manager.lookup(key(1), reader) is LookupResult.HIT_PENDING  # still in flight
        manager.complete_store([key(1)], writer, success=success)
        manager.on_schedule_end(STEP_END)
        answer = manager.lookup(key(1), reader)
        assert answer is (LookupResult.HIT if success else LookupResult.MISS)
        if success:
            assert manager.get_load_source(key(1), reader) is CacheHitSource.HOST
        manager.on_request_finished(reader)
    finally:
        manager.shutdown()

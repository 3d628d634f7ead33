"""kvtier's disk tier as a secondary tier of vLLM 0.33's own tiering (TieringOffloadingSpec).

vLLM's spec, CPU primary tier and tiering manager are the real ones; bytes are written into
vLLM's primary region as its GPU worker would, and must come back from kvtier's disk tier
byte for byte — after a cache reset, after a restart — or not at all (a corrupted block).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_support import (
    STEP_END,
    corrupt_block,
    key,
    offloading_config,
    payload,
    prometheus,
    run_steps_until,
    tiering_extra,
)

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import KvtierDiskTier


class Tiering:
    """vLLM's TieringOffloadingSpec and manager with one KvtierDiskTier, from settings alone."""

    def __init__(self, tier: dict, **config_options):
        self.config = offloading_config(tiering_extra(tier), **config_options)
        self.spec = OffloadingSpecFactory.create_spec(self.config)
        assert isinstance(self.spec, TieringOffloadingSpec)
        self.manager = self.spec.get_manager()
        (self.tier,) = self.manager.secondary_tiers
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1]

    def store(self, keys, ctx) -> None:
        """One request storing ``keys``: GPU -> primary as vLLM's worker would (bytes into the
        chunks), complete_store (which cascades to the disk tier), the request's end."""
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and out.keys_to_store == list(keys)
        for k, chunk in zip(keys, out.store_spec.chunk_ids):
            self.rows[chunk] = payload(k, self.row_bytes)
        self.manager.complete_store(keys, ctx)  # cascades to the disk tier
        self.manager.on_request_finished(ctx)
        self.manager.on_schedule_end(STEP_END)  # the storing step ends
        self.tier.drain_jobs()
        # vLLM's manager polls its tiers once per step, first thing: the next step sees the
        # finished cascade
        self.manager.on_schedule_end(STEP_END)
        assert not self.manager.has_pending_work()

    def forget_primary(self) -> None:
        """Empty vLLM's CPU tier and overwrite its bytes: what comes back must come from disk."""
        self.manager.reset_cache()
        self.manager.on_reset_flushed()
        self.rows[:] = 0xAA

    def assert_loads(self, keys, ctx) -> None:
        spec = self.manager.prepare_load(keys, ctx)
        for k, chunk in zip(keys, spec.chunk_ids):
            np.testing.assert_array_equal(self.rows[chunk], payload(k, self.row_bytes))
        self.manager.complete_load(keys, ctx)

    def shutdown(self) -> None:
        del self.rows  # vLLM unmaps its region at shutdown: hold no view of it
        self.manager.shutdown()


def disk(path, kind: str = "lmdb", **options) -> dict:
    return {"kind": kind, "path": str(path), "capacity": "16MiB", **options}


def test_vllms_factories_build_the_tier_from_its_secondary_tiers_entry(tmp_path):
    entry = {"type": "KvtierDiskTier", "module_path": "kvtier.integrations.vllm"}
    assert SecondaryTierFactory.get_tier_class(entry) is KvtierDiskTier
    tiering = Tiering(disk(tmp_path / "s", "files", eviction="lru", fsync="none", o_direct="off"))
    try:
        tier = tiering.tier
        assert isinstance(tier, KvtierDiskTier)
        assert tier.tier_type == "KvtierDiskTier"
        assert tier.medium is Medium.STORAGE and tier.cache_hit_source is CacheHitSource.DISK
        assert (tier.config.kind, tier.config.fsync, tier.config.o_direct) == (
            "files",
            "none",
            "off",
        )
        assert tier.config.capacity_bytes == 16 << 20
        assert tier.tier.block_bytes == tiering.row_bytes  # one vLLM chunk row per block
        assert tier.tier.fingerprint.world_size == 1
        assert tier.config_info()["kvtier_kind"] == "files"
    finally:
        tiering.shutdown()


@pytest.mark.parametrize(
    ("entry", "field", "fix"),
    [
        (
            {"kind": "lmdbb", "path": "/tmp/x", "capacity": "1GiB"},
            "secondary_tiers[KvtierDiskTier].kind",
            "did you mean 'lmdb'",
        ),
        ({"kind": "lmdb", "capacity": "1GiB"}, "secondary_tiers[KvtierDiskTier].path", "add path"),
        (
            {"kind": "files", "path": "/tmp/x", "capacity": "1G"},
            "secondary_tiers[KvtierDiskTier].capacity",
            "1GiB",
        ),
        (
            {"kind": "files", "path": "/tmp/x", "capacity": "1GiB", "fsyncc": "none"},
            "secondary_tiers[KvtierDiskTier].fsyncc",
            "did you mean 'fsync'",
        ),
    ],
)
def test_a_bad_entry_is_a_config_error_naming_the_secondary_tier(entry, field, fix):
    with pytest.raises(ConfigError) as raised:
        Tiering(entry)
    assert raised.value.field == field
    assert fix in str(raised.value)


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_bytes_round_trip_through_the_disk_tier_into_vllms_primary(tmp_path, kind):
    tiering = Tiering(disk(tmp_path / "store", kind))
    try:
        keys = [key(i) for i in range(6)]
        tiering.store(keys, ReqContext("writer"))
        assert tiering.tier.tier.num_blocks() == 6
        tiering.forget_primary()
        reader = ReqContext("reader")
        tiering.manager.on_new_request(reader)
        assert [tiering.manager.lookup(k, reader) for k in keys] == [LookupResult.HIT_PENDING] * 6
        assert run_steps_until(tiering.manager, keys, reader) == [LookupResult.HIT] * 6
        assert {tiering.manager.get_load_source(k, reader) for k in keys} == {CacheHitSource.DISK}
        tiering.assert_loads(keys, reader)
        figures = tiering.tier.stats()
        assert figures["stored"] == 6 and figures["loaded"] == 6 and figures["corrupt"] == 0
        tiering.manager.on_request_finished(reader)
    finally:
        tiering.shutdown()


def test_an_out_of_tree_kind_serves_vllms_tiering_from_its_entry_alone(monkeypatch):
    """A tier kind kvtier does not know (tests/outside/remote_tier.py), named by class path in
    the secondary_tiers entry (its module_path key is vLLM's), built through vLLM's factory."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "outside"))
    import remote_tier

    remote_tier.BUCKETS.clear()
    tiering = Tiering({"kind": "remote_tier:RemoteTierConfig", "url": "mem://vllm", "capacity": "16MiB"})
    try:
        assert type(tiering.tier.config) is remote_tier.RemoteTierConfig
        assert tiering.tier.config_info()["kvtier_path"] == "mem://vllm"
        keys = [key(i) for i in range(5)]
        tiering.store(keys, ReqContext("writer"))
        assert set(remote_tier.BUCKETS["mem://vllm"]) == set(keys)
        tiering.forget_primary()
        reader = ReqContext("reader")
        tiering.manager.on_new_request(reader)
        assert run_steps_until(tiering.manager, keys, reader) == [LookupResult.HIT] * 5
        tiering.assert_loads(keys, reader)  # byte for byte, from the out-of-tree tier
        assert tiering.tier.stats()["loaded"] == 5
        tiering.manager.on_request_finished(reader)
    finally:
        tiering.shutdown()
        remote_tier.BUCKETS.clear()


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_a_restarted_engine_is_served_from_the_disk_tier(tmp_path, kind):
    keys = [key(i) for i in range(5)]
    first = Tiering(disk(tmp_path / "store", kind))
    first.store(keys, ReqContext("before"))
    first.shutdown()

    second = Tiering(disk(tmp_path / "store", kind))  # a new engine id and primary region
    try:
        assert second.tier.tier.num_blocks() == 5  # the index survived
        ctx = ReqContext("after")
        second.manager.on_new_request(ctx)
        assert run_steps_until(second.manager, keys, ctx) == [LookupResult.HIT] * 5
        second.assert_loads(keys, ctx)
    finally:
        second.shutdown()


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_a_corrupted_block_is_a_miss_and_the_rest_of_its_job_is_kept(tmp_path, kind):
    store = tmp_path / "store"
    keys = [key(i) for i in range(4)]
    first = Tiering(disk(store, kind))
    row_bytes = first.row_bytes
    first.store(keys, ReqContext("before"))
    first.shutdown()
    corrupt_block(str(store), row_bytes, keys[1])

    second = Tiering(disk(store, kind))
    try:
        ctx = ReqContext("after")
        second.manager.on_new_request(ctx)
        # one promotion job for all four keys: a partial failure
        answers = run_steps_until(second.manager, keys, ctx)
        assert answers == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
        good = [keys[0], keys[2], keys[3]]
        second.assert_loads(good, ctx)
        figures = second.tier.stats()
        assert figures["corrupt"] == 1 and figures["loaded"] == 3
        assert second.tier.lookup(keys[1], ctx) is LookupResult.MISS  # dropped, never served
    finally:
        second.shutdown()


def test_job_results_translate_for_vllm(tmp_path):
    """TierJobResult -> JobResult: a partly failed promotion names its verified keys, the job's
    bytes and time come along, and a key being written looks up RETRY."""
    store = tmp_path / "store"
    keys = [key(i) for i in range(3)]
    first = Tiering(disk(store))
    row_bytes = first.row_bytes
    first.store(keys, ReqContext("w"))
    first.shutdown()
    corrupt_block(str(store), row_bytes, keys[0])

    second = Tiering(disk(store))
    try:
        tier, ctx = second.tier, ReqContext("r")
        rows = np.array([5, 6, 7], dtype=np.int32)
        tier.submit_load(TransferJob(41, keys, rows, True, ctx))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert (result.job_id, result.success) == (41, False)
        assert set(result.successful_keys) == {keys[1], keys[2]}
        assert result.transfer_bytes == 2 * row_bytes and result.transfer_time >= 0
        for k, row in zip(keys[1:], rows[1:]):
            np.testing.assert_array_equal(second.rows[row], payload(k, row_bytes))

        new = key(99)
        second.rows[9] = payload(new, row_bytes)
        tier.submit_store(TransferJob(42, [new], np.array([9], dtype=np.int32), False, ctx))
        assert tier.lookup(new, ctx) is LookupResult.RETRY  # written, not committed yet
        assert tier.has_pending_work()
        tier.drain_jobs()
        (stored,) = tier.get_finished_jobs()
        assert (stored.job_id, stored.success, stored.successful_keys) == (42, True, None)
        assert tier.lookup(new, ctx) is LookupResult.HIT
        assert not tier.has_pending_work()
    finally:
        second.shutdown()


def test_a_changed_model_never_reads_old_blocks(tmp_path):
    keys = [key(i) for i in range(3)]
    first = Tiering(disk(tmp_path / "store"))
    first.store(keys, ReqContext("w"))
    first.shutdown()
    second = Tiering(disk(tmp_path / "store"), model="test-org/another-model")
    try:
        ctx = ReqContext("r")
        second.manager.on_new_request(ctx)
        assert [second.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
    finally:
        second.shutdown()


def test_events_and_stats(tmp_path):
    tiering = Tiering(disk(tmp_path / "store"), events=True)
    try:
        tiering.store([key(1)], ReqContext("w"))
        events = [e for e in tiering.manager.take_events() if e.medium is Medium.STORAGE]
        assert [(e.keys, e.removed) for e in events] == [([key(1)], False)]
        stats = tiering.tier.get_stats()
        definitions = KvtierDiskTier.build_metric_definitions({})
        (name,) = stats.data["data"]
        assert name in definitions
        series = stats.data["data"][name]
        assert all(len(labels) == len(definitions[name].labelnames) for labels in series)
        assert series[("disk", "stored")] == 1
        assert set(tiering.tier.config_info()) == set(KvtierDiskTier.config_info_keys({}))
    finally:
        tiering.shutdown()
    quiet = Tiering(disk(tmp_path / "quiet"), events=False)
    try:
        quiet.store([key(1)], ReqContext("w"))
        assert [e for e in quiet.manager.take_events() if e.medium is Medium.STORAGE] == []
        assert quiet.tier.tier.take_events() == []  # drained as results were polled
    finally:
        quiet.shutdown()


def test_any_parallel_layout_is_fingerprinted(tmp_path):
    """vLLM's tiering keeps every worker's shard in one row; the tier stores rows whatever the
    layout, and the fingerprint keeps layouts apart."""
    tiering = Tiering(disk(tmp_path / "store"), world_size=2)
    try:
        fingerprint = tiering.tier.tier.fingerprint
        assert fingerprint.world_size == 2 and "tp=2" in fingerprint.model
        assert tiering.row_bytes == 2 * tiering.config.worker_kv_bytes_per_block
    finally:
        tiering.shutdown()


def test_the_tiers_statistics_reach_vllms_prometheus_metrics(tmp_path):
    tiering = Tiering(disk(tmp_path / "store", name="nvme"))
    sink, registry = prometheus(tiering.config.extra_config)
    try:
        tiering.store([key(1), key(2)], ReqContext("w"))
        stats = tiering.manager.get_stats()  # vLLM's tiering manager aggregates its tiers'
        sink.observe(stats.data)
        for name, value in (("stored", 2), ("blocks", 2), ("corrupt", 0)):
            sample = registry.get_sample_value(
                "vllm:kv_offload_kvtier_disk_stat",
                {"engine": "0", "kvtier_tier": "nvme", "stat": name},
            )
            assert sample == value, name
    finally:
        tiering.shutdown()

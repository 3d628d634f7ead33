"""kvtier's whole stack as vLLM 0.33's offloading spec, built and driven through vLLM's own API."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

import numpy as np
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadPolicy,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_support import (
    NUM_LAYERS,
    PAGE_BYTES,
    STEP_END,
    StandInGPU,
    corrupt_block,
    drain_disk,
    key,
    kvtier_extra,
    offloading_config,
    payload,
    run_steps_until,
)

from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.vllm import TieredOffloadingSpec
from kvtier.integrations.vllm.manager import STATS_METRIC

BLOCK_BYTES = NUM_LAYERS * PAGE_BYTES


def cpu_tier(capacity: str = "1MiB") -> dict:
    return {"name": "cpu", "kind": "cpu", "capacity": capacity, "pin_memory": "off"}


def disk_tier(path, kind: str = "lmdb", capacity: str = "8MiB") -> dict:
    return {"name": "nvme", "kind": kind, "path": str(path), "capacity": capacity}


class Engine:
    """One engine: the scheduler's spec and manager, one worker's spec and worker, built the
    way vLLM builds them (separate spec objects from one OffloadingConfig per process)."""

    def __init__(self, extra: dict, gpu_blocks: int = 64, **config_options):
        config = offloading_config(extra, **config_options)
        self.config = config
        self.scheduler_spec = OffloadingSpecFactory.create_spec(config)
        self.worker_spec = OffloadingSpecFactory.create_spec(config)
        self.gpu = StandInGPU(gpu_blocks)
        # vLLM's order: workers register their KV caches before the scheduler exists
        self.worker = self.worker_spec.get_worker(self.gpu.canonical())
        self.manager = self.scheduler_spec.get_manager()
        self._job_ids = iter(range(1, 1 << 30))

    def store(self, keys, ctx, gpu_blocks) -> list[bytes]:
        """The connector's store path for one chunk per key: prepare_store, the worker's
        copy, complete_store. Returns the keys the manager took."""
        for k, block in zip(keys, gpu_blocks):
            self.gpu.write_chunk([block], k)
        out = self.manager.prepare_store(keys, ctx)
        if out is None:  # no room now (every row held): vLLM skips the store, so do we
            return []
        assert set(out.keys_to_store) <= set(keys)
        assert not set(out.evicted_keys) & set(keys), "evicted a key of its own offer"
        if out.keys_to_store:
            blocks = [gpu_blocks[list(keys).index(k)] for k in out.keys_to_store]
            job = next(self._job_ids)
            src = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
            assert self.worker.submit_store(job, src, out.store_spec)
            self.worker.wait({job})
            assert [(r.job_id, r.success) for r in self.worker.get_finished()] == [(job, True)]
            self.manager.complete_store(out.keys_to_store, ctx)
        return list(out.keys_to_store)

    def load(self, keys, ctx, gpu_blocks) -> None:
        """The connector's load path: prepare_load of HIT keys, the worker's copy, complete_load."""
        self.gpu.scribble(gpu_blocks)
        src = self.manager.prepare_load(keys, ctx)
        job = next(self._job_ids)
        dst = GPULoadStoreSpec(gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[0])
        assert self.worker.submit_load(job, src, dst)
        self.worker.wait({job})
        assert [(r.job_id, r.success) for r in self.worker.get_finished()] == [(job, True)]
        self.manager.complete_load(keys, ctx)

    def assert_holds(self, k: bytes, gpu_block: int) -> None:
        got = self.gpu.read_chunk([gpu_block])
        np.testing.assert_array_equal(got, payload(k, BLOCK_BYTES))

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


# -- built from settings alone ------------------------------------------------------------------


def test_factory_builds_the_spec_from_a_kvtier_yaml_file(tmp_path):
    yaml_path = tmp_path / "tiers.yaml"
    yaml_path.write_text(
        "tiers:\n"
        "  - {name: cpu, kind: cpu, capacity: 1MiB, pin_memory: off}\n"
        f"  - {{name: nvme, kind: lmdb, path: {tmp_path / 'store'}, capacity: 8MiB}}\n"
    )
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "kvtier_config": str(yaml_path),
        "block_size": 32,
    }
    config = offloading_config(extra, blocks_per_chunk=2)  # what vLLM derives from block_size
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, TieredOffloadingSpec) and isinstance(spec, OffloadingSpec)
    assert spec.layout.block_size_factor == 2
    assert spec.layout.block_bytes == 2 * BLOCK_BYTES
    assert [t.kind for t in spec.layout.config.tiers] == ["cpu", "lmdb"]
    assert spec.layout.region_path.endswith("kvtier-" + config.engine_id)
    manager = spec.get_manager()
    try:
        assert isinstance(manager, OffloadingManager)
        assert manager is spec.get_manager()
        assert manager.inner.backend.block_size == 2 * BLOCK_BYTES
        assert manager.inner.tiers[0].fingerprint == spec.layout.fingerprint
        ctx = ReqContext("r")
        assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    finally:
        manager.shutdown()


def test_factory_builds_the_spec_from_inline_keys_and_it_moves_bytes(tmp_path):
    engine = Engine(kvtier_extra([cpu_tier()]))
    try:
        assert isinstance(engine.worker, OffloadingWorker)
        ctx = ReqContext("r")
        keys = [key(i) for i in range(4)]
        assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 4
        assert engine.store(keys, ctx, [3, 4, 5, 6]) == keys
        assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        engine.load(keys, ctx, [20, 21, 22, 23])
        for k, block in zip(keys, [20, 21, 22, 23]):
            engine.assert_holds(k, block)
            assert engine.manager.get_load_source(k, ctx) is CacheHitSource.HOST
    finally:
        engine.shutdown()


def test_an_engine_starts_when_its_derived_region_name_was_taken_first():
    """Issue #32, item 6: the region's name is derived from the engine id, which another
    local user may know (a fixed ``engine_id``, or ``ps``); a file they put there first no
    longer stops the engine: the region gets a random suffix the worker finds."""
    import os
    import uuid
    from pathlib import Path

    from kvtier.tiers.cpu.region import default_directory

    engine_id = f"known-{uuid.uuid4().hex[:8]}"
    taken = Path(default_directory()) / f"kvtier-{engine_id}"
    taken.write_bytes(b"planted")
    try:
        engine = Engine(kvtier_extra([cpu_tier()]), engine_id=engine_id)
        try:
            ctx = ReqContext("r")
            keys = [key(i) for i in range(2)]
            assert engine.store(keys, ctx, [3, 4]) == keys
            engine.load(keys, ctx, [20, 21])
            for k, block in zip(keys, [20, 21]):
                engine.assert_holds(k, block)
            region = engine.worker._standalone.region_path
            assert region.startswith(str(taken) + "-") and os.path.exists(region)
        finally:
            engine.shutdown()
        assert taken.read_bytes() == b"planted"  # never touched
    finally:
        taken.unlink()


@pytest.mark.parametrize("chosen", [None, "auto", "kernel"])
def test_the_copy_engine_setting_reaches_the_workers_handlers(chosen):
    extra = kvtier_extra([cpu_tier()])
    if chosen is not None:
        extra["kvtier_copy_engine"] = chosen
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert spec.layout.copy_engine == (chosen or "auto")
    worker = spec.get_worker(StandInGPU(8).canonical())
    try:
        assert worker._standalone.engine == (chosen or "auto")  # what get_handlers builds with
    finally:
        worker.shutdown()


def test_the_worker_attaches_lazily_because_vllm_builds_workers_first():
    config = offloading_config(kvtier_extra([cpu_tier()]))
    worker_spec = OffloadingSpecFactory.create_spec(config)
    gpu = StandInGPU(8)
    worker = worker_spec.get_worker(gpu.canonical())
    assert not worker.started and worker.get_finished() == []  # polled every step: never waits
    scheduler_spec = OffloadingSpecFactory.create_spec(config)
    manager = scheduler_spec.get_manager()  # creates the region the worker attaches to
    try:
        ctx = ReqContext("r")
        out = manager.prepare_store([key(0)], ctx)
        gpu.write_chunk([1], key(0))
        assert worker.submit_store(7, GPULoadStoreSpec([1], [1], [0]), out.store_spec)
        assert worker.started
        worker.wait({7})
        assert [r.success for r in worker.get_finished()] == [True]
    finally:
        worker.shutdown()
        manager.shutdown()


def test_an_expedited_load_does_not_queue_behind_ordinary_loads():
    # vLLM waits for an expedited load within the step: it has a handler (an engine, a
    # stream) of its own, so an ordinary load still running cannot hold it up
    engine = Engine(kvtier_extra([cpu_tier()]), gpu_blocks=8)
    try:
        ctx = ReqContext("r")
        assert engine.store([key(0), key(1)], ctx, [1, 2]) == [key(0), key(1)]
        engine.worker._started()
        ordinary = engine.worker._load.engine
        held, release = threading.Event(), threading.Event()
        original = ordinary.copy

        def held_up(*descriptors):
            held.set()
            assert release.wait(30)
            return original(*descriptors)

        ordinary.copy = held_up
        first = engine.manager.prepare_load([key(0)], ctx)
        second = engine.manager.prepare_load([key(1)], ctx)
        assert engine.worker.submit_load(20, first, GPULoadStoreSpec([5], [1], [0]))
        assert held.wait(30)  # the ordinary load is inside its copy, and stays there
        assert engine.worker.submit_load(21, second, GPULoadStoreSpec([6], [1], [0]), expedited=True)
        engine.worker.wait({21})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(21, True)]
        engine.assert_holds(key(1), 6)
        release.set()
        engine.worker.wait({20})
        assert [(r.job_id, r.success) for r in engine.worker.get_finished()] == [(20, True)]
        engine.assert_holds(key(0), 5)
        engine.manager.complete_load([key(0), key(1)], ctx)
    finally:
        release.set()
        engine.shutdown()


def test_the_worker_attaches_in_the_background_once_the_region_exists():
    # pinning a large region takes about 0.1 s per GB: done off the model's thread, before
    # the first job, not inside it
    config = offloading_config(kvtier_extra([cpu_tier()]))
    worker = OffloadingSpecFactory.create_spec(config).get_worker(StandInGPU(8).canonical())
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        deadline = time.monotonic() + 30
        while not worker.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.started  # no job was submitted
    finally:
        worker.shutdown()
        manager.shutdown()


def test_a_background_start_that_failed_raises_at_the_first_job():
    # pin_memory "on" without CUDA: the region exists, so the failure is the worker's pinning
    config = offloading_config(kvtier_extra([{**cpu_tier(), "pin_memory": "on"}]))
    worker = OffloadingSpecFactory.create_spec(config).get_worker(StandInGPU(8).canonical())
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        worker._starter.join(30)
        assert not worker.started
        out = manager.prepare_store([key(0)], ReqContext("r"))
        with pytest.raises(KvtierError, match="pin_memory is 'on' but CUDA is not available"):
            worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), out.store_spec)
    finally:
        worker.shutdown()
        manager.shutdown()


@pytest.mark.parametrize(
    ("extra", "options", "field", "fix"),
    [
        (
            {"cpu_bytes_to_use": 1 << 30},
            {},
            "kv_connector_extra_config.cpu_bytes_to_use",
            "tiers[0].capacity",
        ),
        (
            {"secondary_tiers": []},
            {},
            "kv_connector_extra_config.secondary_tiers",
            "KvtierDiskTier",
        ),
        ({"canonical_layout": True}, {}, "kv_connector_extra_config.canonical_layout", "remove"),
        ({"block_size_tokens": 64}, {}, "block_size_tokens", '"block_size": 64'),
        (
            {"kvtier_stats_log_interval_s": -1},
            {},
            "kv_connector_extra_config.kvtier_stats_log_interval_s",
            "e.g. 60",
        ),
        (
            {"kvtier_copy_engine": "dma"},
            {},
            "kv_connector_extra_config.kvtier_copy_engine",
            "kvtier bench transfer --device cuda",
        ),
    ],
)
def test_settings_kvtier_cannot_honour_are_config_errors(extra, options, field, fix):
    config = offloading_config(kvtier_extra([cpu_tier()], **extra), **options)
    with pytest.raises(ConfigError) as raised:
        OffloadingSpecFactory.create_spec(config)
    assert raised.value.field == field
    assert fix in str(raised.value)


def test_a_misspelt_kvtier_key_is_named_with_the_key_meant():
    config = offloading_config({**kvtier_extra([cpu_tier()]), "casade": {}})
    with pytest.raises(ConfigError, match="did you mean 'cascade'"):
        OffloadingSpecFactory.create_spec(config)


def test_vllm_connector_keys_are_left_to_vllm():
    extra = kvtier_extra(
        [cpu_tier()], blocks_per_chunk=1, self_describing_kv_events=True, offload_prompt_only=False
    )
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert spec.offload_prompt_only is False  # read by vLLM's base class, untouched by kvtier
    assert spec.layout.block_size_factor == 1


# -- the connector scheduler's call sequence ----------------------------------------------------


def test_connector_call_sequence_over_cpu_and_disk_keeps_vllms_invariants(tmp_path):
    """Requests sharing prefixes, a CPU tier of 8 blocks and a disk below, driven the way
    OffloadingConnectorScheduler drives a manager: per request, lookups chunk by chunk (a
    pending answer defers the request to the next step, a MISS ends its hit), prepare_load of
    the hits, the worker's copies, complete_*, prepare_store of the new chunks, and
    on_request_finished; on_schedule_end ends every step.

    Checked on every call: a HIT can be pinned by prepare_load and loads the key's own bytes;
    prepare_store only takes offered keys, never those just looked up HIT, and never evicts a
    key of its own offer; a deferred lookup resolves (HIT or MISS) within bounded steps; the
    published events account for every block that became loadable or was dropped.
    """
    cpu_capacity = 8 * 4096 * 2  # 8 rows of 8 KiB
    extra = kvtier_extra(
        [cpu_tier(str(cpu_capacity)), disk_tier(tmp_path / "store")],
        cascade={"write_policy": "write_back"},
    )
    engine = Engine(extra, gpu_blocks=64)
    manager = engine.manager
    rng = np.random.default_rng(7)
    # 40 requests over 6 prefixes of up to 6 chunks: prefixes repeat, the CPU tier overflows
    requests = []
    for r in range(40):
        prefix = int(rng.integers(0, 6))
        chunks = [key(prefix * 100 + i) for i in range(int(rng.integers(3, 7)))]
        requests.append((f"req-{r}", chunks))

    loadable: set[bytes] = set()  # CPU-resident keys, from the events
    seen_disk_hits = 0
    max_deferrals = 0
    for req_id, chunks in requests:
        ctx = ReqContext(req_id)
        assert manager.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
        deferrals = 0
        while True:
            hits: list[bytes] = []
            pending = False
            for k in chunks:  # _maximal_prefix_lookup
                answer = manager.lookup(k, ctx)
                if answer is LookupResult.MISS:
                    break
                if answer is LookupResult.HIT:
                    hits.append(k)
                else:
                    pending = True
            if not pending:
                break
            deferrals += 1
            assert deferrals < 100, "a deferred lookup never resolved"
            manager.on_schedule_end(STEP_END)  # the request waits for the next step
            drain_disk(manager)
            for event in manager.take_events():
                (loadable.difference_update if event.removed else loadable.update)(
                    k for k in event.keys if event.medium is Medium.CPU
                )
        max_deferrals = max(max_deferrals, deferrals)
        gpu_blocks = list(range(len(chunks)))
        if hits:
            engine.load(hits, ctx, gpu_blocks[: len(hits)])
            for k, block in zip(hits, gpu_blocks):
                engine.assert_holds(k, block)
                if manager.get_load_source(k, ctx) is CacheHitSource.DISK:
                    seen_disk_hits += 1
        new = chunks[len(hits) :]
        if new:
            taken = engine.store(new, ctx, gpu_blocks[len(hits) :])
            assert set(taken) <= set(new)
            assert not set(taken) & set(hits)
        out_evicted = []
        manager.on_request_finished(ctx)
        manager.on_schedule_end(STEP_END)
        drain_disk(manager)  # the model's forward pass: time for the step's disk writes
        for event in manager.take_events():
            assert event.medium in (Medium.CPU, Medium.STORAGE)
            if event.medium is Medium.CPU:
                if event.removed:
                    out_evicted += event.keys
                    loadable.difference_update(event.keys)
                else:
                    loadable.update(event.keys)
        # every CPU-resident key per the events looks up HIT; evicted ones never do from CPU
        for k in loadable:
            assert manager.inner.policy.contains(k)
        for k in out_evicted:
            assert not manager.inner.policy.contains(k)

    assert seen_disk_hits > 0, "the workload never brought a block back from disk"
    assert max_deferrals > 0
    figures = manager.stats()
    assert figures["nvme.promotions"] > 0 and figures["nvme.corrupt_blocks"] == 0
    engine.shutdown()


def test_a_promotion_is_hit_pending_then_hit_and_reports_disk_as_source(tmp_path):
    extra = kvtier_extra(
        [cpu_tier(), disk_tier(tmp_path / "store")], cascade={"write_policy": "write_through"}
    )
    engine = Engine(extra)
    try:
        writer = ReqContext("writer")
        keys = [key(i) for i in range(3)]
        engine.store(keys, writer, [1, 2, 3])
        engine.manager.on_schedule_end(STEP_END)
        drain_disk(engine.manager)
        engine.manager.on_schedule_end(STEP_END)  # polls the finished writes
        engine.manager.reset_cache()
        engine.manager.on_reset_flushed()
        reader = ReqContext("reader")
        assert [engine.manager.lookup(k, reader) for k in keys] == [LookupResult.HIT_PENDING] * 3
        assert engine.manager.has_pending_work()
        assert run_steps_until(engine.manager, keys, reader) == [LookupResult.HIT] * 3
        assert {engine.manager.get_load_source(k, reader) for k in keys} == {CacheHitSource.DISK}
        engine.load(keys, reader, [30, 31, 32])
        for k, block in zip(keys, [30, 31, 32]):
            engine.assert_holds(k, block)
    finally:
        engine.shutdown()


def test_a_hit_larger_than_the_cpu_tier_resolves_instead_of_thrashing(tmp_path):
    """Ten chunks on disk, a CPU tier of six rows: promoting the later chunks must not evict the
    earlier ones the waiting request already found (it would never resolve). The request gets a
    prefix that fits, byte for byte, the rest is a MISS, and every pin is released."""
    extra = kvtier_extra(
        [cpu_tier(str(6 * BLOCK_BYTES)), disk_tier(tmp_path / "store")],
        cascade={"write_policy": "write_through"},
    )
    engine = Engine(extra)
    try:
        keys = [key(i) for i in range(10)]
        for start in range(0, 10, 2):  # stored two at a time: the CPU tier holds six
            engine.store(keys[start : start + 2], ReqContext(f"w{start}"), [1, 2])
            engine.manager.on_schedule_end(STEP_END)
            drain_disk(engine.manager)
            engine.manager.on_schedule_end(STEP_END)
        assert engine.manager.inner.tiers[0].num_blocks() == 10
        engine.manager.reset_cache()
        engine.manager.on_reset_flushed()

        ctx = ReqContext("long-prompt")
        for _ in range(50):  # the connector's prefix lookup, once per step
            answers = []
            for k in keys:
                answers.append(engine.manager.lookup(k, ctx))
                if answers[-1] is LookupResult.MISS:
                    break
            if LookupResult.HIT_PENDING not in answers:
                break
            engine.manager.on_schedule_end(STEP_END)
            drain_disk(engine.manager)
        else:
            raise AssertionError(f"the request never resolved: {answers}")
        hits = [k for k, a in zip(keys, answers) if a is LookupResult.HIT]
        assert answers == [LookupResult.HIT] * len(hits) + [LookupResult.MISS]
        assert 1 <= len(hits) <= 6
        engine.load(hits, ctx, list(range(20, 20 + len(hits))))
        for k, block in zip(hits, range(20, 20 + len(hits))):
            engine.assert_holds(k, block)
        engine.manager.on_schedule_end(STEP_END)  # the step in which it resolved ends
        assert engine.manager.stats()["held_blocks"] == 0
    finally:
        engine.shutdown()


def test_after_reset_cache_no_promotion_starts_until_vllm_says_the_workers_flushed(tmp_path):
    extra = kvtier_extra(
        [cpu_tier(), disk_tier(tmp_path / "store")], cascade={"write_policy": "write_through"}
    )
    engine = Engine(extra)
    try:
        ctx = ReqContext("r")
        engine.store([key(1)], ctx, [1])
        engine.manager.on_schedule_end(STEP_END)
        drain_disk(engine.manager)
        engine.manager.on_schedule_end(STEP_END)
        assert engine.manager.inner.tiers[0].lookup(key(1)) is True
        engine.manager.reset_cache()
        # a late DMA of a pre-reset job may still write freed rows: a disk hit is a MISS now,
        # and nothing is queued
        assert engine.manager.lookup(key(1), ctx) is LookupResult.MISS
        engine.manager.on_schedule_end(STEP_END)
        assert not engine.manager.has_pending_work()
        engine.manager.on_reset_flushed()
        assert engine.manager.lookup(key(1), ctx) is LookupResult.HIT_PENDING
    finally:
        engine.shutdown()


# -- disk: restart, layout, corruption ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_blocks_survive_an_engine_restart(tmp_path, kind):
    extra = kvtier_extra([cpu_tier(), disk_tier(tmp_path / "store", kind)])  # write_back
    first = Engine(extra)
    keys = [key(i) for i in range(5)]
    first.store(keys, ReqContext("before"), [1, 2, 3, 4, 5])
    first.shutdown()  # saves what only the CPU tier held

    second = Engine(extra)  # a new engine id: a new CPU region, the same disk
    try:
        ctx = ReqContext("after")
        assert run_steps_until(second.manager, keys, ctx) == [LookupResult.HIT] * 5
        second.load(keys, ctx, [10, 11, 12, 13, 14])
        for k, block in zip(keys, [10, 11, 12, 13, 14]):
            second.assert_holds(k, block)
    finally:
        second.shutdown()


@pytest.mark.parametrize(
    "change",
    [{"model": "test-org/another-model"}, {"dtype": "float16"}, {"kv_cache_layout": "HND"}],
)
def test_a_changed_model_or_layout_never_reads_old_blocks(tmp_path, change):
    extra = kvtier_extra([cpu_tier(), disk_tier(tmp_path / "store")])
    first = Engine(extra)
    keys = [key(i) for i in range(3)]
    first.store(keys, ReqContext("before"), [1, 2, 3])
    first.shutdown()

    second = Engine(extra, **change)
    try:
        ctx = ReqContext("after")
        assert [second.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
        assert second.manager.stats()["nvme.blocks"] == 0
    finally:
        second.shutdown()


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_a_corrupted_block_on_disk_is_a_miss_never_wrong_bytes(tmp_path, kind):
    store = tmp_path / "store"
    extra = kvtier_extra([cpu_tier(), disk_tier(store, kind)])
    first = Engine(extra)
    keys = [key(i) for i in range(4)]
    first.store(keys, ReqContext("before"), [1, 2, 3, 4])
    first.shutdown()
    corrupt_block(str(store), BLOCK_BYTES, keys[2])

    second = Engine(extra)
    try:
        ctx = ReqContext("after")
        answers = run_steps_until(second.manager, keys, ctx)
        assert answers == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        good = [k for k, a in zip(keys, answers) if a is LookupResult.HIT]
        second.load(good, ctx, [10, 11, 12])
        for k, block in zip(good, [10, 11, 12]):
            second.assert_holds(k, block)
        figures = second.manager.stats()
        assert figures["nvme.corrupt_blocks"] == 1 and figures["nvme.promotions"] == 3
    finally:
        second.shutdown()


# -- events, stats, config info -----------------------------------------------------------------


def test_events_name_vllms_media_and_stay_silent_when_vllm_publishes_none(tmp_path):
    extra = kvtier_extra([cpu_tier(), disk_tier(tmp_path / "on")], cascade={"write_policy": "write_through"})
    engine = Engine(extra)
    try:
        ctx = ReqContext("r")
        engine.store([key(1), key(2)], ctx, [1, 2])
        engine.manager.on_schedule_end(STEP_END)
        drain_disk(engine.manager)
        engine.manager.on_schedule_end(STEP_END)
        stored = {(e.medium, e.removed, tuple(sorted(e.keys))) for e in engine.manager.take_events()}
        both = tuple(sorted([key(1), key(2)]))
        assert stored == {(Medium.CPU, False, both), (Medium.STORAGE, False, both)}
        assert list(engine.manager.take_events()) == []  # each event once
    finally:
        engine.shutdown()

    quiet = Engine(
        kvtier_extra([cpu_tier(), disk_tier(tmp_path / "off")], cascade={"write_policy": "write_through"}),
        events=False,
    )
    try:
        ctx = ReqContext("r")
        quiet.store([key(1)], ctx, [1])
        quiet.manager.on_schedule_end(STEP_END)
        drain_disk(quiet.manager)
        quiet.manager.on_schedule_end(STEP_END)
        assert list(quiet.manager.take_events()) == []
        assert quiet.manager.inner.tiers[0].take_events() == []  # drained, not piling up
    finally:
        quiet.shutdown()


def test_stats_and_config_info_match_what_the_spec_declares(tmp_path):
    extra = kvtier_extra([cpu_tier(), disk_tier(tmp_path / "store")])
    engine = Engine(extra)
    try:
        definitions = TieredOffloadingSpec.build_metric_definitions(extra)
        stats = engine.manager.get_stats()
        for name, series in stats.data["data"].items():
            assert name in definitions
            assert all(len(labels) == len(definitions[name].labelnames) for labels in series)
        figures = {labels[0]: value for labels, value in stats.data["data"][STATS_METRIC].items()}
        assert figures == engine.manager.stats()
        # kvtier's own names too (kvtier.integrations.vllm.metrics): a gauge as it stands
        blocks = stats.data["data"]["kvtier_tier_blocks"]
        assert blocks[("nvme",)] == figures["nvme.blocks"]
        (info,) = engine.manager.config_info()
        assert tuple(info) == TieredOffloadingSpec.config_info_keys(extra)
        assert info["kvtier_tiers"] == "cpu:cpu:1MiB,nvme:lmdb:8MiB"
        assert info["kvtier_block_bytes"] == BLOCK_BYTES
    finally:
        engine.shutdown()


def test_load_spec_is_vllms_cpu_spec():
    engine = Engine(kvtier_extra([cpu_tier()]))
    try:
        ctx = ReqContext("r")
        engine.store([key(1)], ctx, [1])
        spec = engine.manager.prepare_load([key(1)], ctx)
        assert isinstance(spec, CPULoadStoreSpec) and len(spec.chunk_ids) == 1
        engine.manager.complete_load([key(1)], ctx)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("world_size", "rank", "replicated", "shards", "offset"),
    [(4, 2, False, 4, 2 * BLOCK_BYTES), (2, 1, True, 1, 0), (1, 0, False, 1, 0)],
)
def test_each_worker_has_its_shard_of_one_row_per_block(world_size, rank, replicated, shards, offset):
    import dataclasses

    config = offloading_config(kvtier_extra([cpu_tier()]), world_size=world_size, rank=rank)
    config = dataclasses.replace(config, replicated_layout=replicated)
    spec = OffloadingSpecFactory.create_spec(config)
    assert spec.layout.block_bytes == shards * BLOCK_BYTES  # the scheduler's row: every shard
    assert spec.layout.shard.offset == offset
    assert spec.layout.shard.writes is (rank == 0 or not replicated)
    assert spec.replicated_layout is replicated  # vLLM's connector then has rank 0 write alone
    # a replicated row is the same bytes at any world size: its fingerprint names none
    assert spec.layout.fingerprint.world_size == (1 if replicated else world_size)
    assert f"shards={shards}" in spec.layout.fingerprint.model


def test_a_tp2_and_a_tp4_layout_of_equal_rows_have_different_fingerprints():
    tp2 = offloading_config(kvtier_extra([cpu_tier()]), world_size=2, bytes_per_block=2 * BLOCK_BYTES)
    tp4 = offloading_config(kvtier_extra([cpu_tier()]), world_size=4, bytes_per_block=BLOCK_BYTES)
    a, b = (OffloadingSpecFactory.create_spec(c).layout for c in (tp2, tp4))
    assert a.block_bytes == b.block_bytes and a.fingerprint.digest() != b.fingerprint.digest()

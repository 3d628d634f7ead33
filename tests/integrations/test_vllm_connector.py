"""kvtier under vLLM 0.33's own offloading connector: its config translation, scheduler side and
worker side are vLLM's code, unchanged; only the engine loop around them is this test's.

``build_offloading_config`` turns a (minimal) vLLM config and a real ``KVCacheConfig`` into the
``OffloadingConfig``; ``OffloadingConnectorScheduler`` makes every manager call (lookups per
chunk, deferrals, prepare_load/prepare_store, complete_*, on_request_finished,
on_schedule_end); ``OffloadingConnectorWorker`` registers the KV caches and submits the jobs
to kvtier's worker. The loop stands in for vLLM's scheduler and model: it admits requests,
allocates GPU blocks, "computes" a chunk by writing bytes derived from the chunk's key, and
hands worker results back. A loaded chunk must hold its key's bytes, byte for byte.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

import copy
import itertools
from types import SimpleNamespace as Namespace

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_support import SPEC_MODULE, drain_disk, payload, prometheus

from kvtier.integrations.vllm import KvtierOffloadingManager, TieredOffloadingSpec

BLOCK_TOKENS = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_GPU_BLOCKS = 96
ATTENTION = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
PAGE = ATTENTION.page_size_bytes  # K and V of one block of one layer: 4096 bytes


def vllm_config(
    extra_config: dict, engine_id: str, tp_size: int = 1, rank: int = 0, mla: bool = False
) -> Namespace:
    """The parts of a VllmConfig that vLLM's offloading code reads, for a 2-layer model with
    one KV head per rank (``mla``: the model says it uses MLA, whose KV every rank holds)."""
    return Namespace(
        kv_transfer_config=Namespace(kv_connector_extra_config=extra_config, engine_id=engine_id),
        parallel_config=Namespace(
            world_size=tp_size,
            rank=rank,
            tensor_parallel_size=tp_size,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            distributed_executor_backend="mp",
            nnodes_within_dp=1,
            cp_kv_cache_interleave_size=1,
        ),
        cache_config=Namespace(
            block_size=BLOCK_TOKENS,
            prefix_match_unit=None,
            cache_dtype="auto",
            kv_cache_layout="NHD",
            enable_prefix_caching=True,
            prefix_cache_retention_interval=None,
        ),
        model_config=Namespace(
            model="test-org/tiny-model",
            dtype=torch.bfloat16,
            max_model_len=4096,
            use_mla=mla,
            get_total_num_kv_heads=lambda: 1 if mla else tp_size,
        ),
        use_v2_model_runner=False,
        kv_events_config=None,
        speculative_config=None,
    )


def kv_cache_config(kv_tp_replicas: int = 1) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=NUM_GPU_BLOCKS * len(LAYERS) * PAGE,
                layers=list(LAYERS),
                layer_stride=NUM_GPU_BLOCKS * PAGE,
                block_stride=PAGE,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), ATTENTION)],
        kv_tp_replicas=kv_tp_replicas,
    )


class EngineLoop:
    """vLLM's connector halves around a stand-in scheduler and model (one request at a time).

    ``tp_size`` workers, each with its own cache, spec and ``OffloadingConnectorWorker`` built
    from its own rank's config, as vLLM's worker processes build them; their outputs are
    combined by vLLM's ``KVOutputAggregator`` before the scheduler sees them. ``mla``: every
    rank holds the same KV, and vLLM's replicated layout has one rank write it.
    """

    def __init__(self, extra_config: dict, engine_id: str, tp_size: int = 1, mla: bool = False):
        init_none_hash(sha256)
        self.tp_size, self.mla = tp_size, mla
        self.vllm_config = vllm_config(extra_config, engine_id, tp_size, 0, mla)
        self.kv_config = kv_cache_config(tp_size if mla else 1)
        config = build_offloading_config(self.vllm_config, self.kv_config)
        # Workers first, as vLLM does: KV caches are registered before the scheduler exists.
        self.rank_caches = []
        self.workers = []
        for rank in range(tp_size):
            rank_config = vllm_config(extra_config, engine_id, tp_size, rank, mla)
            caches = {
                name: torch.zeros((NUM_GPU_BLOCKS, 2, BLOCK_TOKENS, 1, 64), dtype=torch.bfloat16)
                for name in LAYERS
            }
            worker_spec = OffloadingSpecFactory.create_spec(
                build_offloading_config(rank_config, self.kv_config)
            )
            worker = OffloadingConnectorWorker(worker_spec, rank_config, self.kv_config)
            worker.register_kv_caches(caches)
            self.rank_caches.append(caches)
            self.workers.append(worker)
        self.caches = self.rank_caches[0]
        self.aggregator = KVOutputAggregator(tp_size)
        scheduler_spec = OffloadingSpecFactory.create_spec(config)
        assert isinstance(scheduler_spec, TieredOffloadingSpec)
        self.scheduler = OffloadingConnectorScheduler(scheduler_spec, self.vllm_config, self.kv_config)
        self.manager = self.scheduler.manager
        assert isinstance(self.manager, KvtierOffloadingManager)
        self.hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self.next_free = 1  # GPU block 0 is vLLM's null block
        self.deferred_steps = 0
        self.loaded_chunks = 0
        self.sources: dict[CacheHitSource, int] = {}

    # -- the stand-in model ------------------------------------------------------------------

    def page_bytes(self, block: int, rank: int = 0) -> np.ndarray:
        caches = self.rank_caches[rank]
        parts = [caches[name][block].view(torch.uint8).reshape(-1).numpy() for name in LAYERS]
        return np.concatenate(parts)

    def shard_key(self, key: bytes, rank: int) -> bytes:
        """What decides a rank's bytes of a chunk: the key, and the rank unless KV is replicated."""
        return key if self.mla else key + bytes([rank])

    def compute(self, block: int, key: bytes) -> None:
        """The model writes the KV of one chunk on every rank: bytes determined by the chunk's
        key and the rank's heads."""
        for rank, caches in enumerate(self.rank_caches):
            data = torch.from_numpy(payload(self.shard_key(key, rank), len(LAYERS) * PAGE).copy())
            for i, name in enumerate(LAYERS):
                caches[name][block].view(torch.uint8).reshape(-1)[:] = data[i * PAGE : (i + 1) * PAGE]

    # -- one engine step -----------------------------------------------------------------------

    def step(self, new=(), scheduled=None, finished=()) -> None:
        """build_connector_meta for the step, the worker's transfers, their results back."""
        output = Namespace(
            scheduled_new_reqs=list(new),
            scheduled_cached_reqs=Namespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
            num_scheduled_tokens=dict(scheduled or {}),
            finished_req_ids=set(finished),
            preempted_req_ids=None,
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
        )
        meta = self.scheduler.build_connector_meta(output)
        jobs = set(meta.load_jobs) | set(meta.store_jobs)
        outputs = []
        for worker in self.workers:
            # each worker process receives its own copy of the metadata (and pops from it)
            rank_meta = copy.deepcopy(meta)
            worker.handle_preemptions(rank_meta)
            worker.start_kv_transfers(rank_meta)
            worker.prepare_store_kv(rank_meta)
            # vLLM submits a step's stores at the start of the next step; flush them now so
            # the step's results are complete (a test has no next forward pass to overlap with).
            worker.handle_preemptions(Namespace(jobs_to_flush=None, store_jobs={}))
            worker.worker.wait(jobs)
            _, recving = worker.get_finished(set())
            outputs.append(
                Namespace(
                    kv_connector_output=KVConnectorOutput(
                        finished_recving=recving or None,
                        kv_connector_worker_meta=worker.build_connector_worker_meta(),
                    )
                )
            )
        combined = self.aggregator.aggregate(outputs).kv_connector_output
        worker_meta = combined.kv_connector_worker_meta or OffloadingWorkerMetadata()
        # every rank finished every job of the step: the scheduler completes each once
        assert {job: worker_meta.completed_jobs.get(job) for job in jobs} == {
            job: self.tp_size for job in jobs
        }
        self.scheduler.update_connector_output(combined)
        drain_disk(self.manager)  # the forward pass: time for the disk I/O of the step

    def serve(self, req_id: str, prompt: list[int]) -> int:
        """Admit, load what the offload tiers hold, compute the rest, finish. Returns the
        number of tokens loaded from kvtier."""
        request = Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        self.scheduler.on_new_request(request)
        while True:
            hit, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            if hit is not None:
                break
            self.deferred_steps += 1
            assert self.deferred_steps < 500, "lookups never resolved"
            self.step()  # the request waits; the step ends (on_schedule_end)
        num_blocks = -(-len(prompt) // BLOCK_TOKENS)
        blocks = list(range(self.next_free, self.next_free + num_blocks))
        self.next_free += num_blocks
        assert self.next_free < NUM_GPU_BLOCKS
        for block, caches in itertools.product(blocks, self.rank_caches):
            for name in LAYERS:
                caches[name][block] = -1.0  # stale bytes: a load must overwrite them
        keys = [make_offload_key(h, 0) for h in request.block_hashes]
        vllm_blocks = KVCacheBlocks(([KVCacheBlock(block_id=b) for b in blocks],))
        self.scheduler.update_state_after_alloc(request, vllm_blocks, hit)
        if hit:
            assert is_async
            for source, tokens in self.scheduler.get_external_cache_hit_sources(request, hit).items():
                self.sources[source] = self.sources.get(source, 0) + tokens
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.step()  # the load runs
            for chunk, rank in itertools.product(range(hit // BLOCK_TOKENS), range(self.tp_size)):
                np.testing.assert_array_equal(
                    self.page_bytes(blocks[chunk], rank),
                    payload(self.shard_key(keys[chunk], rank), len(LAYERS) * PAGE),
                    err_msg=f"{req_id}: rank {rank}'s chunk {chunk} is not its key's bytes",
                )
            self.loaded_chunks += hit // BLOCK_TOKENS
        request.num_computed_tokens = hit
        request.status = RequestStatus.RUNNING
        for chunk in range(hit // BLOCK_TOKENS, num_blocks):
            if chunk < len(keys):
                self.compute(blocks[chunk], keys[chunk])
        new = Namespace(req_id=req_id, block_ids=(blocks,))
        self.step(new=[new], scheduled={req_id: len(prompt) - hit})  # stores run
        request.num_computed_tokens = len(prompt)
        request.status = RequestStatus.FINISHED_STOPPED
        self.scheduler.request_finished(request)
        self.step(finished=[req_id])  # on_request_finished
        self.next_free = 1  # the request's GPU blocks are free again (no GPU prefix cache)
        return hit

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def prompt(prefix: int, chunks: int) -> list[int]:
    """A prompt of ``chunks`` full chunks plus a few tokens, sharing its start with every
    prompt of the same ``prefix``."""
    return [prefix * 1000 + i for i in range(chunks * BLOCK_TOKENS + 3)]


def test_vllms_connector_drives_the_whole_stack_through_cpu_and_disk(tmp_path):
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            # 10 CPU rows of 8 KiB for 6 prefixes of up to 8 chunks: most hits come from disk
            {"kind": "cpu", "capacity": 10 * 8192, "pin_memory": "off"},
            {"name": "nvme", "kind": "lmdb", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
    }
    engine = EngineLoop(extra, "kvtier-connector-test")
    try:
        rng = np.random.default_rng(3)
        hits = 0
        for r in range(30):
            tokens = engine.serve(f"req-{r}", prompt(int(rng.integers(0, 6)), int(rng.integers(2, 9))))
            hits += tokens > 0
        figures = engine.manager.stats()
        assert hits > 10 and engine.loaded_chunks > 20
        assert engine.deferred_steps > 0  # some hits waited for a promotion
        assert figures["nvme.promotions"] > 0 and figures["nvme.corrupt_blocks"] == 0
        assert engine.sources.get(CacheHitSource.DISK, 0) > 0
        assert engine.sources.get(CacheHitSource.HOST, 0) > 0
    finally:
        engine.shutdown()


def test_vllms_connector_is_served_from_disk_after_a_restart(tmp_path):
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "files", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
    }
    first = EngineLoop(extra, "kvtier-restart-a")
    try:
        assert first.serve("before", prompt(1, 6)) == 0
    finally:
        first.shutdown()  # writes the CPU tier's blocks down
    second = EngineLoop(extra, "kvtier-restart-b")
    try:
        assert second.serve("after", prompt(1, 6)) == 6 * BLOCK_TOKENS
        assert second.loaded_chunks == 6 and second.deferred_steps > 0
        assert second.sources == {CacheHitSource.DISK: 6 * BLOCK_TOKENS}
    finally:
        second.shutdown()


def test_miss_causes_reach_vllms_prometheus_metrics(tmp_path):
    """A prompt never seen misses as new, through vLLM's own lookups; the cause counters and
    the sketch's size and error rate reach vLLM's gauges like every kvtier figure."""
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "lmdb", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
        "miss_causes": {"keys": 4096},
    }
    sink, registry = prometheus(extra)
    engine = EngineLoop(extra, "kvtier-miss-causes-test")
    try:
        engine.serve("r", prompt(2, 4))
        engine.step()
        sink.observe(engine.scheduler.get_stats().data)
        figures = engine.manager.stats()
        assert figures["misses"] >= 1
        assert figures["miss_new"] == figures["misses"]
        assert figures["miss_evicted"] == 0 and figures["nvme.miss_evicted"] == 0
        assert figures["sketch_keys"] == 4096 and figures["sketch_bytes"] <= 16 * 4096
        for name in ("miss_new", "miss_evicted", "nvme.miss_evicted", "sketch_bytes", "sketch_error_rate"):
            sample = registry.get_sample_value("vllm:kv_offload_kvtier_stat", {"engine": "0", "stat": name})
            assert sample == figures[name], name
    finally:
        engine.shutdown()


def test_kvtiers_statistics_reach_vllms_prometheus_metrics(tmp_path):
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "lmdb", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
        "cascade": {"write_policy": "write_through"},
    }
    sink, registry = prometheus(extra)  # built from the spec's declared metrics, as vLLM does
    engine = EngineLoop(extra, "kvtier-prometheus-test")
    try:
        engine.serve("r", prompt(2, 4))
        engine.step()
        stats = engine.scheduler.get_stats()  # what the engine core ships to the frontend
        sink.observe(stats.data)
        figures = engine.manager.stats()
        assert figures["nvme.demotions"] == 4
        for name in ("nvme.demotions", "nvme.blocks", "ready_blocks", "lookups"):
            sample = registry.get_sample_value("vllm:kv_offload_kvtier_stat", {"engine": "0", "stat": name})
            assert sample == figures[name], name
        info = registry.get_sample_value(
            "vllm:kv_offload_config_info",
            {
                "engine": "0",
                "kvtier_tiers": "cpu:cpu:1MiB,nvme:lmdb:8MiB",
                "kvtier_block_bytes": str(len(LAYERS) * PAGE),
                "kvtier_block_size_tokens": "16",
                "kvtier_write_policy": "write_through",
            },
        )
        assert info == 1.0
    finally:
        engine.shutdown()


def test_kvtiers_metrics_reach_vllms_prometheus_under_their_own_names(tmp_path):
    """kvtier's conventional metrics (docs/reference/metrics.md) go through vLLM 0.33's
    offloading metrics path: counters as increments per get_stats, which add up to kvtier's
    totals however many payloads they took; histograms with every job in its bucket."""
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "64KiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "files", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
        "cascade": {"write_policy": "write_through"},
    }
    sink, registry = prometheus(extra)
    engine = EngineLoop(extra, "kvtier-own-metrics-test")
    try:
        payloads = 0
        for round_ in range(3):  # the CPU tier holds 8 blocks: later rounds read earlier ones up
            for i in range(4):
                engine.serve(f"r{round_}-{i}", prompt(i, 4))
                engine.step()
                sink.observe(engine.scheduler.get_stats().data)
                payloads += 1
        drain_disk(engine.manager)
        engine.step()
        sink.observe(engine.scheduler.get_stats().data)
        figures = engine.manager.stats()
        seconds = engine.manager.inner.job_seconds()
    finally:
        engine.shutdown()

    def get(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert figures["nvme.demotions"] > 0 and figures["nvme.promotions"] > 0 and payloads == 12
    assert get("kvtier_lookups_blocks_total") == figures["lookups"]
    assert get("kvtier_lookup_hits_blocks_total", tier="cpu") == figures["cpu_hits"]
    assert get("kvtier_lookup_hits_blocks_total", tier="nvme") == figures["nvme.promotions"]
    assert get("kvtier_moved_blocks_total", tier="nvme", direction="store") == figures["nvme.demotions"]
    assert get("kvtier_moved_bytes_total", tier="nvme", direction="load") == figures["nvme.promoted_bytes"]
    assert get("kvtier_evictions_blocks_total", tier="cpu") == figures["evictions"]
    assert get("kvtier_tier_blocks", tier="nvme") == figures["nvme.blocks"]
    # every miss has its cause, under the metric's cause label; none is left unattributed
    assert get("kvtier_lookup_misses_blocks_total", tier="", cause="new") == figures["miss_new"] > 0
    assert get("kvtier_lookup_misses_blocks_total", tier="", cause="unattributed") in (
        0,
        None,
    )  # None: not sent
    for direction, jobs in (("load", "nvme.promote_jobs"), ("store", "nvme.demote_jobs")):
        count = get("kvtier_job_duration_seconds_count", tier="nvme", direction=direction)
        assert count == seconds[("nvme", direction)].count == figures[jobs] > 0
        for bound, cumulative in seconds[("nvme", direction)].cumulative()[:-1]:
            le = repr(float(bound))
            assert (
                get("kvtier_job_duration_seconds_bucket", tier="nvme", direction=direction, le=le)
                == cumulative
            )
    # every figure also stays on the generic gauge, as before
    assert get("vllm:kv_offload_kvtier_stat", stat="nvme.demotions") == figures["nvme.demotions"]


def test_the_extra_configs_metrics_section_gives_a_stats_file_and_an_endpoint(tmp_path):
    """metrics: in kv_connector_extra_config starts kvtier's own endpoint and stats file in the
    scheduler process, stopped (after a last snapshot) by the manager's shutdown."""
    import json
    import urllib.request

    from kvtier_testing.running import free_port

    from kvtier.metrics.view import parse_text

    port, path = free_port(), tmp_path / "stats.json"
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "files", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
        "cascade": {"write_policy": "write_through"},
        "metrics": {"port": port, "stats_file": str(path), "stats_interval_s": 60},
    }
    engine = EngineLoop(extra, "kvtier-metrics-section-test")
    try:
        engine.serve("r", prompt(3, 4))
        engine.step()
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        scraped = {(n, tuple(sorted(labels.items()))): v for n, labels, v in parse_text(page)}
        assert scraped[("kvtier_lookups_blocks_total", ())] == engine.manager.stats()["lookups"] > 0
    finally:
        engine.shutdown()
    final = json.loads(path.read_text())
    assert final["stats"] == engine.manager.stats() and final["stats"]["nvme.demotions"] == 4


@pytest.mark.parametrize("mla", [False, True], ids=["tp2", "tp2-mla-replicated"])
def test_vllms_connector_drives_two_tensor_parallel_workers_through_cpu_and_disk(tmp_path, mla):
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"name": "nvme", "kind": "files", "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
    }
    engine_id = f"kvtier-tp2-{int(mla)}"
    first = EngineLoop(extra, engine_id + "-a", tp_size=2, mla=mla)
    try:
        layout = first.workers[1].spec.layout
        assert layout.shard.rank == 1 and layout.shard.writes is not mla
        shards = 1 if mla else 2
        assert first.manager.inner.backend.block_size == shards * len(LAYERS) * PAGE
        assert first.workers[1].spec.replicated_layout is mla
        assert first.serve("before", prompt(4, 5)) == 0  # stores on both ranks
        assert first.serve("again", prompt(4, 5)) == 5 * BLOCK_TOKENS  # from the CPU tier
    finally:
        first.shutdown()  # writes the CPU tier's rows (both shards) down
    second = EngineLoop(extra, engine_id + "-b", tp_size=2, mla=mla)
    try:
        assert second.serve("after", prompt(4, 5)) == 5 * BLOCK_TOKENS
        assert second.sources == {CacheHitSource.DISK: 5 * BLOCK_TOKENS}
    finally:
        second.shutdown()


def test_a_store_that_fails_on_one_rank_drops_the_block_on_every_rank(tmp_path):
    """vLLM 0.33 cannot carry a failed transfer (its worker asserts success, its scheduler
    completes a job once every rank acknowledged it): the failing rank marks the rows, the
    manager drops those blocks, and the engine goes on and recomputes them."""
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": SPEC_MODULE,
        "tiers": [{"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"}],
    }
    engine = EngineLoop(extra, "kvtier-tp2-failure", tp_size=2)
    try:
        broken = engine.workers[1].worker
        broken._started()  # the scheduler exists: attached by now, or now
        copy_engine = broken._store.engine
        original = copy_engine.copy

        def fail_once(*descriptors):
            copy_engine.copy = original
            raise OSError("injected DMA failure")

        copy_engine.copy = fail_once
        assert engine.serve("first", prompt(5, 3)) == 0  # its one store job fails on rank 1
        figures = engine.manager.stats()
        assert figures["ready_blocks"] == 0 and figures["pending_blocks"] == 0
        assert engine.serve("second", prompt(5, 3)) == 0  # dropped: a miss, stored again
        assert engine.serve("third", prompt(5, 3)) == 3 * BLOCK_TOKENS  # both shards exact
    finally:
        engine.shutdown()

"""Tensor- and pipeline-parallel engines: one CPU row per block holds every rank's shard.

Real worker processes (spawned, one per rank, CPU tensors for their GPU caches) attach to the
CPU tier's region by path and copy only their own shard; this process is the scheduler, with
one rank-agnostic manager (one key, one row) and a RankResultAggregator. Bytes are compared
exactly: in the CPU rows after a store, and in every rank's cache after blocks went to disk,
the whole stack restarted and the blocks were loaded back.
"""

from __future__ import annotations

import itertools
import os
import uuid
from importlib.util import find_spec

import numpy as np
import pytest
from kvtier_testing import key
from rank_processes import (
    FACTOR,
    GPU_BLOCK_TOKENS,
    PAGES,
    RankPool,
    chunk_bytes,
    expected_row,
)

from kvtier import ReqContext, TieredOffloadingSpec
from kvtier.tiers.cpu.region import default_directory
from kvtier.worker import RankResultAggregator

CTX = ReqContext("ranks")
SHARD_BYTES = FACTOR * sum(PAGES)
CPU_ROWS = 4
TAGS = range(8)
_job_ids = itertools.count(1)


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(4)
    yield ranks
    ranks.close()


DISK_KIND = "lmdb" if find_spec("lmdb") is not None else "files"


def stack_config(tmp_path, num_shards: int, cpu_rows: int = CPU_ROWS, pin: str = "off") -> dict:
    return {
        "block_size_tokens": FACTOR * GPU_BLOCK_TOKENS,
        "tiers": [
            {
                "kind": "cpu",
                "capacity": cpu_rows * num_shards * SHARD_BYTES,
                "pin_memory": pin,
                "path": os.path.join(default_directory(), f"kvtier-test-{uuid.uuid4().hex}"),
            },
            # lmdb where it is installed (the lent GPU machines may lack it), else files
            {"name": "disk", "kind": DISK_KIND, "path": str(tmp_path / "store"), "capacity": "8MiB"},
        ],
        "cascade": {"write_policy": "write_through"},
    }


def gpu_blocks(tags, first: int = 0) -> list[int]:
    """FACTOR GPU blocks per offloaded block, consecutive from ``first``."""
    return list(range(first, first + FACTOR * len(tags)))


class Engine:
    """The scheduler side of one engine, driving ``world_size`` ranks of the pool."""

    def __init__(self, pool, config, world_size, kv_replicas=1, device="cpu"):
        self.pool, self.config = pool, config
        self.ranks = list(range(world_size))
        self.world_size, self.kv_replicas = world_size, kv_replicas
        self.spec = self._spec()
        self.manager = self.spec.get_manager()
        self.shards = pool.call(
            self.ranks,
            "configure",
            config=config,
            world_size=world_size,
            kv_replicas=kv_replicas,
            device=device,
            per_rank=lambda r: {"rank": r},
        )
        self.aggregator = RankResultAggregator(world_size)

    def _spec(self):
        return TieredOffloadingSpec(
            self.config,
            gpu_block_size_tokens=GPU_BLOCK_TOKENS,
            page_bytes=list(PAGES),
            world_size=self.world_size,
            kv_replicas=self.kv_replicas,
        )

    def restart(self):
        """Shut the manager down (it saves what only the CPU tier holds), start a new one on
        the same paths, and have every rank drop its handlers and cache and attach anew."""
        self.spec.shutdown()
        self.spec = self._spec()
        self.manager = self.spec.get_manager()
        self.pool.call(self.ranks, "restart")

    def transfer(self, store, gpu_ids, cpu_ids, failing=()):
        """One job on every rank; the aggregated result."""
        job_id = next(_job_ids)
        answers = self.pool.call(
            self.ranks,
            "transfer",
            job_id=job_id,
            store=store,
            gpu_ids=gpu_ids,
            cpu_ids=[int(i) for i in cpu_ids],
            per_rank=lambda r: {"fail": r in failing},
        )
        done = []
        for rank, results in enumerate(answers):
            done += self.aggregator.add(rank, [_result(job, ok, size) for job, ok, size in results])
        assert [r.job_id for r in done] == [job_id] and not self.aggregator.pending()
        return done[0]

    def store(self, tags, first_gpu=0, failing=()):
        keys = [key(t) for t in tags]
        out = self.manager.prepare_store(keys, CTX)
        assert out is not None and out.keys_to_store == keys
        rows = out.store_spec.block_ids
        result = self.transfer(True, gpu_blocks(tags, first_gpu), rows, failing)
        if result.success:
            # the row holds every shard at its offset, each written by its rank
            for tag, row in zip(tags, rows):
                np.testing.assert_array_equal(
                    self.manager.backend.rows[row][: self.spec.block_bytes],
                    expected_row(tag, self.world_size // self.kv_replicas),
                    err_msg=f"row of block {tag}",
                )
        self.manager.complete_store(keys, CTX, result.success)
        self.step()
        return result, out

    def step(self):
        self.manager.on_schedule_end()
        for tier in self.manager.tiers:
            tier.drain_jobs()
        self.manager.on_schedule_end()

    def resolve(self, k):
        for _ in range(10):
            answer = self.manager.lookup(k, CTX)
            if answer is not None:
                return answer
            self.step()
        raise AssertionError("lookup never resolved")

    def load(self, tags, first_gpu, failing=()):
        keys = [key(t) for t in tags]
        spec = self.manager.prepare_load(keys, CTX)
        result = self.transfer(False, gpu_blocks(tags, first_gpu), spec.block_ids, failing)
        self.manager.complete_load(keys, CTX)
        return result

    def check_loaded(self, tags, first_gpu):
        """Every rank's cache holds its own shard of each block, byte for byte."""
        answers = self.pool.call(self.ranks, "read", gpu_ids=gpu_blocks(tags, first_gpu))
        for rank, blocks in enumerate(answers):
            shard = self.shards[rank]["shard"]
            for tag, got in zip(tags, blocks):
                want = np.concatenate([chunk_bytes(tag, shard, layer) for layer in range(2)])
                np.testing.assert_array_equal(
                    np.frombuffer(got, dtype=np.uint8), want, err_msg=f"rank {rank}, block {tag}"
                )

    def close(self):
        self.pool.call(self.ranks, "release")
        self.spec.shutdown()


def _result(job_id, success, size):
    from kvtier.base import TransferResult

    return TransferResult(job_id, success, size)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "kv_replicas", "what"),
    [
        (2, 1, "TP=2"),
        (4, 1, "TP=4"),
        (4, 1, "TP=2 x PP=2"),  # 4 ranks, 4 distinct shards: heads and layers split alike
        (2, 2, "TP=2, MLA replicated"),
        (4, 2, "TP=2 x PP=2, MLA replicated"),
    ],
)
def test_store_evict_to_disk_restart_and_load_every_rank_exactly(
    pool, tmp_path, world_size, kv_replicas, what
):
    round_trip(pool, tmp_path, world_size, kv_replicas, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("world_size", "kv_replicas"), [(2, 1), (4, 2)])
def test_ranks_on_cuda_share_one_pinned_region(pool, tmp_path, world_size, kv_replicas):
    """The same round trip with each rank's cache on the GPU: every rank process pins the one
    shared region and copies its shard with the CUDA engine."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    round_trip(pool, tmp_path, world_size, kv_replicas, "cuda")


def round_trip(pool, tmp_path, world_size, kv_replicas, device):
    """Store 8 blocks through a CPU tier of 4 rows (evicting to disk), restart the whole stack,
    bring every block up from disk and load it into every rank, checking bytes throughout."""
    config = stack_config(tmp_path, world_size // kv_replicas, pin="on" if device == "cuda" else "off")
    engine = Engine(pool, config, world_size, kv_replicas, device)
    try:
        # on CUDA every rank registered the shared rows in its own process (or failed to start)
        assert [s["pinned"] for s in engine.shards] == [device == "cuda"] * world_size
        writers = [s["writes"] for s in engine.shards]
        assert writers == [r % kv_replicas == 0 for r in range(world_size)]
        pool.call(engine.ranks, "fill", gpu_ids=gpu_blocks(TAGS), tags=list(TAGS))
        if kv_replicas > 1:
            # a replica that wrote would put these bytes in the row; the row check catches it
            replicas = [r for r in engine.ranks if not writers[r]]
            pool.call(replicas, "scribble", gpu_ids=gpu_blocks(TAGS), value=0x55)
        evicted = []
        for first in range(0, len(TAGS), 2):
            tags = list(TAGS[first : first + 2])
            result, out = engine.store(tags, first_gpu=FACTOR * first)
            assert result.success
            # replicas copy nothing: the job's bytes are one copy of each distinct shard
            assert result.transfer_size == len(tags) * engine.spec.block_bytes
            evicted += out.evicted_keys
        assert evicted, "the CPU tier of 4 rows should have evicted blocks to disk"
        assert engine.manager.stats()["disk.demotions"] > 0

        engine.restart()
        for first in range(0, len(TAGS), 2):
            tags = list(TAGS[first : first + 2])
            for tag in tags:  # the new CPU tier is empty: every block comes up from disk
                assert engine.manager.lookup(key(tag), CTX) is None
            assert all(engine.resolve(key(tag)) is True for tag in tags)
            assert engine.load(tags, first_gpu=20).success
            engine.check_loaded(tags, first_gpu=20)
        assert engine.manager.stats()["disk.corrupt_blocks"] == 0
    finally:
        engine.close()


def test_a_failed_store_on_one_rank_fails_the_block_and_a_retry_stores_it(pool, tmp_path):
    engine = Engine(pool, stack_config(tmp_path, 2, cpu_rows=8), 2)
    try:
        pool.call(engine.ranks, "fill", gpu_ids=gpu_blocks(TAGS), tags=list(TAGS))
        result, _ = engine.store([0, 1], failing={1})
        assert not result.success and result.transfer_size == 0
        assert engine.manager.lookup(key(0), CTX) is False
        assert engine.manager.lookup(key(1), CTX) is False
        assert engine.manager.stats()["ready_blocks"] == 0

        result, _ = engine.store([0, 1])
        assert result.success and engine.manager.lookup(key(0), CTX) is True

        # a load that fails on one rank fails the job; the block stays and loads again
        assert not engine.load([0, 1], first_gpu=20, failing={0}).success
        assert engine.manager.lookup(key(0), CTX) is True
        assert engine.load([0, 1], first_gpu=20).success
        engine.check_loaded([0, 1], first_gpu=20)
    finally:
        engine.close()


def test_a_store_written_at_tp2_is_never_read_at_tp4(tmp_path):
    """Same row size (TP=4 has half the heads per rank), other shard layout: wiped, not read."""
    config = stack_config(tmp_path, 2)
    tp2 = TieredOffloadingSpec(
        config, gpu_block_size_tokens=GPU_BLOCK_TOKENS, page_bytes=list(PAGES), world_size=2
    )
    manager = tp2.get_manager()
    out = manager.prepare_store([key(0)], CTX)
    manager.backend.rows[out.store_spec.block_ids[0]] = 7
    manager.complete_store([key(0)], CTX)
    tp2.shutdown()  # saves the block to disk

    half = [p // 2 for p in PAGES]
    tp4 = TieredOffloadingSpec(config, gpu_block_size_tokens=GPU_BLOCK_TOKENS, page_bytes=half, world_size=4)
    assert tp4.block_bytes == tp2.block_bytes and tp4.fingerprint() != tp2.fingerprint()
    try:
        assert tp4.get_manager().lookup(key(0), CTX) is False
    finally:
        tp4.shutdown()

    again = TieredOffloadingSpec(
        config, gpu_block_size_tokens=GPU_BLOCK_TOKENS, page_bytes=list(PAGES), world_size=2
    )
    try:
        # the TP=4 open wiped the TP=2 blocks: a cache is recomputable, a wrong block is not
        assert again.get_manager().lookup(key(0), CTX) is False
    finally:
        again.shutdown()


@pytest.mark.slow
def test_a_replicated_store_written_at_tp2_is_read_at_tp4(tmp_path):
    """Every rank of an MLA engine holds the same bytes: the row is one shard at any TP size,
    and its fingerprint leaves the world size out, so a TP=4 engine reads what TP=2 wrote."""
    config = stack_config(tmp_path, 1)
    tp2 = TieredOffloadingSpec(
        config,
        gpu_block_size_tokens=GPU_BLOCK_TOKENS,
        page_bytes=list(PAGES),
        world_size=2,
        kv_replicas=2,
    )
    manager = tp2.get_manager()
    out = manager.prepare_store([key(0)], CTX)
    manager.backend.rows[out.store_spec.block_ids[0]] = 7
    manager.complete_store([key(0)], CTX)
    tp2.shutdown()  # saves the block to disk

    tp4 = TieredOffloadingSpec(
        config,
        gpu_block_size_tokens=GPU_BLOCK_TOKENS,
        page_bytes=list(PAGES),
        world_size=4,
        kv_replicas=4,
    )
    assert tp4.block_bytes == tp2.block_bytes and tp4.fingerprint() == tp2.fingerprint()
    manager = tp4.get_manager()
    try:
        for _ in range(4):
            if manager.lookup(key(0), CTX) is not None:
                break
            manager.on_schedule_end()
            for tier in manager.tiers:
                tier.drain_jobs()
        assert manager.lookup(key(0), CTX) is True
        spec = manager.prepare_load([key(0)], CTX)
        assert (manager.backend.rows[spec.block_ids[0]] == 7).all()
        manager.complete_load([key(0)], CTX)
    finally:
        tp4.shutdown()

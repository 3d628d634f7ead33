"""SharedRegion: layout, sharing across processes, validation, release, pinning."""

from __future__ import annotations

import gc
import logging
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import cuda
from kvtier.errors import ConfigError, KvtierError
from kvtier.tiers.cpu import region as region_module
from kvtier.tiers.cpu.region import HEADER_BYTES, SharedRegion, pin_chunks, row_stride_for


@pytest.fixture
def region():
    shared = SharedRegion.create(4, 10_000)
    yield shared
    shared.close()


def _pattern(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# ---------------------------------------------------------------------------------------------
# geometry and layout


def test_create_geometry(region):
    assert region.num_rows == 4
    assert region.row_bytes == 10_000
    assert region.row_stride == 12_288
    assert region.nbytes == 4 * 12_288
    assert region.rows.shape == (4, 10_000)
    assert region.rows.dtype == np.uint8
    assert region.path.startswith("/dev/shm/kvtier-")
    assert region.name == os.path.basename(region.path)
    assert os.path.getsize(region.path) == HEADER_BYTES + region.nbytes
    assert region.is_creator
    assert not region.rows.any()


@pytest.mark.parametrize("row_bytes", [1, 4095, 4096, 4097, 3 * 4096, 100_000])
def test_rows_are_page_aligned(row_bytes):
    with SharedRegion.create(5, row_bytes) as shared:
        assert shared.row_stride == row_stride_for(row_bytes)
        assert shared.row_stride % 4096 == 0
        assert shared.row_stride - 4096 < row_bytes <= shared.row_stride
        assert shared.address % 4096 == 0
        for i in range(shared.num_rows):
            assert shared.row(i).ctypes.data % 4096 == 0
            assert shared.row(i).ctypes.data == shared.address + i * shared.row_stride
        assert shared.rows.flags.c_contiguous == (row_bytes % 4096 == 0)


def test_rows_are_zero_copy_and_do_not_overlap(region):
    expected = _pattern(1, (region.num_rows, region.row_bytes))
    for i in range(region.num_rows):
        region.row(i)[:] = expected[i]
    np.testing.assert_array_equal(region.rows, expected)
    assert np.shares_memory(region.rows, region.row(2))
    with pytest.raises(IndexError):
        region.row(region.num_rows)
    with pytest.raises(IndexError):
        region.row(-1)


def test_header_is_written(region):
    with open(region.path, "rb") as f:
        raw = f.read(48)
    magic, version, header_bytes, num_rows, row_bytes, stride, pid = struct.unpack("<8sIIQQQQ", raw)
    assert (magic, version, header_bytes) == (b"KVTIERSH", 1, 4096)
    assert (num_rows, row_bytes, stride, pid) == (4, 10_000, 12_288, os.getpid())


@pytest.mark.parametrize("num_rows, row_bytes", [(0, 10), (3, 0), (-1, 10), (2, 1.5)])
def test_create_rejects_bad_geometry(num_rows, row_bytes):
    with pytest.raises(ConfigError):
        SharedRegion.create(num_rows, row_bytes)


# ---------------------------------------------------------------------------------------------
# attach


def test_attach_in_same_process(region):
    region.rows[:] = _pattern(2, region.rows.shape)
    for handle in (region.name, region.path):
        other = SharedRegion.attach(handle)
        try:
            assert not other.is_creator
            assert (other.num_rows, other.row_bytes, other.row_stride) == (4, 10_000, 12_288)
            np.testing.assert_array_equal(other.rows, region.rows)
            other.row(3)[:7] = 42
            assert region.row(3)[:7].tolist() == [42] * 7
        finally:
            other.close()
    assert os.path.exists(region.path)


def test_second_process_reads_and_writes(region):
    written = _pattern(3, region.rows.shape)
    region.rows[:] = written
    result = _run_python(
        f"""
        import numpy as np
        from kvtier.tiers.cpu.region import SharedRegion
        shared = SharedRegion.attach({region.name!r})
        assert (shared.num_rows, shared.row_bytes) == ({region.num_rows}, {region.row_bytes})
        expected = np.random.default_rng(3).integers(0, 256, size=shared.rows.shape, dtype=np.uint8)
        assert np.array_equal(shared.rows, expected), "child read different bytes"
        shared.rows[1:3] = np.random.default_rng(4).integers(
            0, 256, size=(2, shared.row_bytes), dtype=np.uint8
        )
        shared.close()
        print("child ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "child ok" in result.stdout
    # the child's close must not remove the creator's file
    assert os.path.exists(region.path)
    np.testing.assert_array_equal(region.rows[1:3], _pattern(4, (2, region.row_bytes)))
    np.testing.assert_array_equal(region.rows[0], written[0])
    np.testing.assert_array_equal(region.rows[3], written[3])


def test_attach_missing_file(tmp_path):
    path = str(tmp_path / "nothing")
    with pytest.raises(KvtierError, match=path):
        SharedRegion.attach(path)


def test_attach_rejects_bad_magic(tmp_path):
    path = tmp_path / "bad-magic"
    path.write_bytes(b"NOTKVTIR" + bytes(3 * 4096))
    with pytest.raises(KvtierError, match="bad magic") as excinfo:
        SharedRegion.attach(str(path))
    assert str(path) in str(excinfo.value)


def test_attach_rejects_unfinished_header(tmp_path):
    # what an attacher racing the creator sees before the header is written: zeros
    path = tmp_path / "zeros"
    path.write_bytes(bytes(2 * 4096))
    with pytest.raises(KvtierError, match=str(path)):
        SharedRegion.attach(str(path))


def test_attach_rejects_file_smaller_than_header(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"KVTIERSH" + bytes(100))
    with pytest.raises(KvtierError, match="too small") as excinfo:
        SharedRegion.attach(str(path))
    assert str(path) in str(excinfo.value)


def test_attach_rejects_truncated_rows(tmp_path):
    path = str(tmp_path / "region")
    with SharedRegion.create(4, 4096, path=path):
        os.truncate(path, HEADER_BYTES + 2 * 4096)
        with pytest.raises(KvtierError, match="truncated") as excinfo:
            SharedRegion.attach(path)
        assert path in str(excinfo.value)


def test_attach_rejects_other_format_version(tmp_path):
    path = str(tmp_path / "region")
    with SharedRegion.create(1, 4096, path=path):
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 99))
        with pytest.raises(KvtierError, match="version 99"):
            SharedRegion.attach(path)


# ---------------------------------------------------------------------------------------------
# explicit paths and release


def test_explicit_path(tmp_path):
    path = str(tmp_path / "tier.shm")
    with SharedRegion.create(2, 100, path=path) as shared:
        assert shared.path == path
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_explicit_path_that_exists_is_refused(tmp_path):
    path = tmp_path / "taken"
    path.write_bytes(b"somebody else's")
    with pytest.raises(KvtierError, match="already exists") as excinfo:
        SharedRegion.create(2, 100, path=str(path))
    assert str(path) in str(excinfo.value)
    assert path.read_bytes() == b"somebody else's"


def test_close_unlinks_and_is_idempotent():
    shared = SharedRegion.create(2, 4096)
    path = shared.path
    shared.close()
    assert not os.path.exists(path)
    assert shared.closed
    shared.close()
    with pytest.raises(KvtierError, match="closed"):
        _ = shared.rows
    with pytest.raises(KvtierError, match="closed"):
        shared.pin("off")


def test_attacher_close_does_not_unlink(region):
    other = SharedRegion.attach(region.path)
    other.close()
    other.close()
    assert os.path.exists(region.path)
    assert region.rows.shape == (4, 10_000)


def test_garbage_collection_unlinks():
    def make() -> str:
        return SharedRegion.create(2, 4096).path

    path = make()
    gc.collect()
    assert not os.path.exists(path)


def test_close_with_live_views_does_not_raise(caplog):
    shared = SharedRegion.create(3, 4096)
    path = shared.path
    rows = shared.rows
    one = shared.row(1)
    rows[1, :4] = [1, 2, 3, 4]
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        shared.close()
    assert not os.path.exists(path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the mapping outlives the file while views hold it, so the views stay valid
    assert one[:4].tolist() == [1, 2, 3, 4]
    del rows, one
    gc.collect()


def test_interpreter_exit_unlinks():
    result = _run_python(
        """
        from kvtier.tiers.cpu.region import SharedRegion
        shared = SharedRegion.create(2, 4096)
        view = shared.rows  # a live view must not stop the release at exit
        print(shared.path)
        """
    )
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path.startswith("/dev/shm/kvtier-")
    assert not os.path.exists(path)
    assert "Traceback" not in result.stderr


def test_forked_child_neither_unlinks_nor_unpins(region, monkeypatch):
    unpinned = []
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n: True)
    monkeypatch.setattr(cuda, "host_unregister", unpinned.append)
    assert region.pin("on")
    pid = os.fork()
    if pid == 0:  # child: close() must leave the parent's file and registration alone
        code = 1
        try:
            pinned_in_child = region.pinned
            region.close()
            code = 0 if not unpinned and not pinned_in_child else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(region.path)
    assert region.pinned
    region.close()
    assert len(unpinned) == 1


# ---------------------------------------------------------------------------------------------
# pinning (CPU side; see the gpu-marked tests for the real thing)


def test_pin_off(region):
    assert region.pin("off") is False
    assert not region.pinned


def test_pin_rejects_unknown_mode(region):
    with pytest.raises(ConfigError, match="pin_memory"):
        region.pin("yes")


@pytest.mark.skipif(
    any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")),
    reason="an NVIDIA device node exists, so auto may import torch",
)
def test_pin_auto_without_gpu_does_not_import_torch():
    result = _run_python(
        """
        import sys
        from kvtier.tiers.cpu.region import SharedRegion
        with SharedRegion.create(2, 4096) as shared:
            assert shared.pin("auto") is False
        assert "torch" not in sys.modules, "pin('auto') imported torch"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_pin_on_without_cuda_raises(region, monkeypatch):
    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    with pytest.raises(KvtierError, match="CUDA is not available"):
        region.pin("on")
    assert region.pin("auto") is False


def test_pin_registers_and_close_unregisters(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n: calls.append(("reg", ptr, n)) or True)
    monkeypatch.setattr(cuda, "host_unregister", lambda ptr: calls.append(("unreg", ptr)))
    shared = SharedRegion.create(3, 5000)
    address = shared.address
    assert shared.pin("auto") is True
    assert shared.pinned
    assert shared.pin("on") is True  # already pinned: no second registration
    shared.close()
    shared.close()
    assert calls == [("reg", address, 3 * 8192), ("unreg", address)]


def test_pin_failure(region, monkeypatch):
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n: False)
    assert region.pin("auto") is False
    with pytest.raises(KvtierError, match="cudaHostRegister"):
        region.pin("on")
    assert not region.pinned


@given(
    address=st.integers(1, 1 << 40),
    nbytes=st.integers(1, 1 << 24),
    pages=st.integers(1, 64),
    spare=st.integers(0, 4095),
)
def test_pin_chunks_cover_the_range_at_page_boundaries(address, nbytes, pages, spare):
    limit = pages * 4096 + spare  # any limit: pieces still never share a page
    chunks = pin_chunks(address, nbytes, limit)
    assert chunks[0][0] == address and sum(size for _, size in chunks) == nbytes
    for (start, size), (following, _) in zip(chunks, chunks[1:]):
        assert start + size == following and following % 4096 == 0
    assert all(0 < size <= limit for _, size in chunks)


def test_a_large_region_is_pinned_in_pieces_all_or_nothing(monkeypatch):
    # r580 drivers refuse one registration of 512 GiB or more: pieces of PIN_CHUNK_BYTES
    calls = []
    monkeypatch.setattr(region_module, "PIN_CHUNK_BYTES", 2 * 8192)
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n: calls.append(("reg", ptr, n)) or True)
    monkeypatch.setattr(cuda, "host_unregister", lambda ptr: calls.append(("unreg", ptr)))
    with SharedRegion.create(5, 8192) as shared:
        address = shared.address
        assert shared.pin("on") is True
        pieces = [(address, 16384), (address + 16384, 16384), (address + 32768, 8192)]
        assert calls == [("reg", start, size) for start, size in pieces]
    assert calls[3:] == [("unreg", start) for start, _ in pieces]  # every piece, at close

    # a piece the driver refuses unpins the ones before it, and the region stays unpinned
    calls.clear()
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n: calls.append(("reg", ptr, n)) or len(calls) < 2)
    with SharedRegion.create(5, 8192) as shared:
        address = shared.address
        assert shared.pin("auto") is False and not shared.pinned
        assert calls == [("reg", address, 16384), ("reg", address + 16384, 16384), ("unreg", address)]
        with pytest.raises(KvtierError, match="cudaHostRegister"):
            shared.pin("on")


# ---------------------------------------------------------------------------------------------
# GPU


# cuda.cuda_available() is torch.cuda.is_available() wherever an NVIDIA driver is present,
# and spares the CPU-only run the import of torch during collection.
@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("row_bytes", [8192, 5000])
def test_gpu_pinned_copies_round_trip(row_bytes):
    torch = pytest.importorskip("torch")
    with SharedRegion.create(8, row_bytes) as shared:
        assert shared.pin("on") is True
        host = torch.from_numpy(shared.rows)
        assert host.is_pinned()
        sent = _pattern(5, (4, row_bytes))
        shared.rows[:4] = sent
        device = torch.empty((4, row_bytes), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            device.copy_(host[:4], non_blocking=True)  # H2D from pinned rows
            device.add_(1)
            host[4:].copy_(device, non_blocking=True)  # D2H into other pinned rows
        stream.synchronize()
        np.testing.assert_array_equal(shared.rows[:4], sent)
        np.testing.assert_array_equal(shared.rows[4:], sent + np.uint8(1))
        del host


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_gpu_a_region_pinned_in_pieces_copies_as_one(monkeypatch):
    # adjacent registrations, page against page, then one copy across all of them
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(region_module, "PIN_CHUNK_BYTES", 3 * 4096)
    with SharedRegion.create(8, 8192) as shared:
        assert shared.pin("on") is True
        assert len(shared._state.pinned_ptrs) == 6  # 64 KiB in pieces of 12 KiB
        host = torch.from_numpy(shared.rows)
        assert host.is_pinned()
        sent = _pattern(7, (4, 8192))
        shared.rows[:4] = sent
        device = torch.empty((4, 8192), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            device.copy_(host[:4], non_blocking=True)
            host[4:].copy_(device, non_blocking=True)
        stream.synchronize()
        np.testing.assert_array_equal(shared.rows[4:], sent)
        del host


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_gpu_failed_register_warns_once_and_leaves_cuda_usable(caplog):
    torch = pytest.importorskip("torch")
    with SharedRegion.create(2, 4096) as shared:
        assert shared.pin("on") is True
        with caplog.at_level(logging.WARNING, logger="kvtier.cuda"):
            # registering the same range twice fails in the driver
            assert cuda.host_register(shared.address, shared.nbytes) is False
        assert len([r for r in caplog.records if r.name == "kvtier.cuda"]) == 1
        # the failed call's error code must not surface in the next kernel launch
        x = torch.ones(16, device="cuda")
        assert float((x * 2).sum()) == 32.0

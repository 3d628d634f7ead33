"""Copy engines: the descriptors both engines issue, the portable fallback, engine choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import cuda
from kvtier.worker.blocks import Segments, TransferLayout
from kvtier.worker.engines import make_engine, resolve_engine_kind
from kvtier.worker.engines.base import CopyBuffers, copy_segments_torch
from kvtier.worker.engines.memcpy_batch import MemcpyBatch
from kvtier.worker.engines.thread import ThreadCopyEngine, memmove_descriptors
from kvtier.tiers.cpu.region import SharedRegion

PAGES = (24, 40)


@pytest.fixture
def setup():
    generator = torch.Generator().manual_seed(3)
    base = torch.randint(-128, 128, (6, 3, 40), dtype=torch.int8, generator=generator)
    # tensor 0 is strided: 24 bytes of each 120-byte block; tensor 1 is contiguous
    gpu = [
        base[:, 0, :24],
        torch.randint(-128, 128, (6, 40), dtype=torch.int8, generator=generator),
    ]
    region = SharedRegion.create(5, 2 * sum(PAGES))  # row 128 bytes, stride 4096
    region.rows[:] = np.random.default_rng(4).integers(0, 256, region.rows.shape, dtype=np.uint8)
    layout = TransferLayout(
        page_bytes=PAGES,
        block_size_factor=2,
        group_copy_bytes=[PAGES],
        gpu_num_blocks=[6, 6],
        gpu_block_strides=[t.stride(0) for t in gpu],
        cpu_num_rows=5,
        cpu_row_stride=region.row_stride,
    )
    yield gpu, region, CopyBuffers(gpu, region), layout
    region.close()


def test_descriptors_are_base_plus_offset(setup):
    gpu, region, buffers, layout = setup
    segments = layout.plan(np.array([5, 1, 2, 3]), [4], None, np.array([4, 0]), gpu_to_cpu=True)
    dsts, srcs, sizes = buffers.descriptors(segments, gpu_to_cpu=True)
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    bases = [t.data_ptr() for t in gpu]
    assert srcs.tolist() == [
        bases[t] + off for t, off in zip(segments.tensor_idx.tolist(), segments.gpu_offsets.tolist())
    ]
    assert dsts.tolist() == [region.address + off for off in segments.cpu_offsets.tolist()]
    assert sizes.tolist() == segments.sizes.tolist()
    back = buffers.descriptors(segments, gpu_to_cpu=False)
    assert back[0].tolist() == srcs.tolist() and back[1].tolist() == dsts.tolist()


def test_descriptors_refuse_a_copy_outside_the_buffers(setup):
    _, _, buffers, _ = setup

    def one(v):
        return np.array([v], dtype=np.int64)

    past_gpu = Segments(one(0), one(5 * 120 + 10), one(0), one(24), 24)
    past_cpu = Segments(one(1), one(0), one(5 * 4096 - 8), one(16), 16)
    for segments in (past_gpu, past_cpu):
        with pytest.raises(AssertionError, match="leaves its buffer"):
            buffers.descriptors(segments, gpu_to_cpu=True)


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_torch_fallback_copies_what_memmove_copies(setup, gpu_to_cpu):
    gpu, region, buffers, layout = setup
    if gpu_to_cpu:
        segments = layout.plan(np.array([5, 1, 2, 3]), [4], None, np.array([4, 0]), gpu_to_cpu=True)
    else:
        segments = layout.plan(np.array([5, 1, 2]), [3], [1], np.array([4, 0]), gpu_to_cpu=False)
    start = ([t.clone() for t in gpu], region.rows.copy())

    memmove_descriptors(*buffers.descriptors(segments, gpu_to_cpu))
    after_memmove = ([t.clone() for t in gpu], region.rows.copy())
    for t, saved in zip(gpu, start[0]):
        t.copy_(saved)
    region.rows[:] = start[1]

    copy_segments_torch(buffers, segments, gpu_to_cpu, non_blocking=False)
    np.testing.assert_array_equal(region.rows, after_memmove[1])
    for t, want in zip(gpu, after_memmove[0]):
        assert torch.equal(t, want)
    changed = (region.rows != start[1]).any() or any(not torch.equal(t, s) for t, s in zip(gpu, start[0]))
    assert changed  # the plan was not empty


def test_engine_choice():
    assert resolve_engine_kind("auto", "cpu") == "thread"
    assert resolve_engine_kind("auto", "cuda") == "cuda"
    assert resolve_engine_kind("thread", "cpu") == "thread"
    with pytest.raises(ValueError, match="unknown copy engine 'dma'"):
        resolve_engine_kind("dma", "cpu")


def test_make_engine_builds_the_thread_engine_for_cpu_tensors(setup):
    _, _, buffers, _ = setup
    engine = make_engine("auto", buffers, True, priority=0)
    try:
        assert isinstance(engine, ThreadCopyEngine) and engine.gpu_to_cpu
    finally:
        engine.shutdown()


@pytest.mark.skipif(cuda.cuda_available(), reason="checks the machine without CUDA")
def test_no_batched_copy_without_a_driver():
    assert MemcpyBatch.load() is None


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_batched_copy_moves_bytes_both_ways():
    batch = MemcpyBatch.load()
    if batch is None:
        pytest.skip("the CUDA driver has no cuMemcpyBatchAsync (needs 12.8+)")
    with SharedRegion.create(2, 8192) as region:
        assert region.pin("on")
        host = torch.from_numpy(region.rows)
        host[0] = torch.randint(0, 256, (8192,), dtype=torch.uint8)
        device = torch.zeros((2, 8192), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the zeros are written

        def u64(*v):
            return np.array(v, dtype=np.uint64)

        # H2D: host row 0 in two pieces into device row 1; then D2H device row 1 to host row 1
        batch(
            u64(device[1].data_ptr(), device[1].data_ptr() + 4096),
            u64(host[0].data_ptr(), host[0].data_ptr() + 4096),
            u64(4096, 4096),
            stream.cuda_stream,
            src_access_any=True,
        )
        batch(
            u64(host[1].data_ptr()),
            u64(device[1].data_ptr()),
            u64(8192),
            stream.cuda_stream,
            src_access_any=False,
        )
        stream.synchronize()
        assert torch.equal(host[1], host[0])
        assert not device[0].any()
        del host

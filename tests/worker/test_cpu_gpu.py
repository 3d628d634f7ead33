"""CpuGpuOffloadingHandlers end to end: bytes, untouched neighbours, order, failures, errors.

Every test body runs on the CPU path (CPU tensors standing in for the GPU cache, the thread
engine) and, under ``@pytest.mark.gpu``, on CUDA with the stream engine (batched DMA) and with
the kernel engine (``cuda+kernel``: the same streams, the bytes moved by a Triton kernel).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from kv_reference import Rig, model_copies

from kvtier import cuda
from kvtier.errors import ConfigError
from kvtier.worker.canonical import canonicalize
from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.cpu.region import SharedRegion

_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=_CUDA),
]
# "device+engine": a rig's tensors on device, its handlers on that copy engine
ENGINES = DEVICES + [
    pytest.param(
        "cuda+kernel",
        id="cuda-kernel",
        marks=[*_CUDA, pytest.mark.skipif(find_spec("triton") is None, reason="needs Triton")],
    ),
]


@pytest.fixture(params=ENGINES)
def device(request):
    """Where a rig runs (``device`` or ``device+engine``), for the tests that build rigs."""
    return request.param


@pytest.fixture(params=ENGINES[1:])
def cuda_engine(request):
    """The CUDA engines only: ``cuda`` (DMA) and ``cuda+kernel``."""
    return request.param


@pytest.fixture(params=DEVICES)
def torch_device(request):
    """A plain torch device, for the tests that build tensors themselves."""
    return request.param


@pytest.fixture
def rigs():
    made = []

    def make(where, *args, **kwargs):
        device, _, engine = where.partition("+")
        rig = Rig(device, *args, engine=engine or "auto", **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def failing_after(engine, calls_ok: int):
    """Make the engine's copy step raise on call number ``calls_ok + 1`` only."""
    name = "issue" if hasattr(engine, "issue") else "copy"
    original = getattr(engine, name)
    count = {"n": 0}

    def step(*args):
        count["n"] += 1
        if count["n"] == calls_ok + 1:
            raise OSError("injected copy failure")
        return original(*args)

    setattr(engine, name, step)


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
@pytest.mark.parametrize("factor", [1, 3])
def test_round_trip_is_byte_exact_and_touches_nothing_else(device, rigs, factor, kv_first):
    rig = rigs(device, factor=factor, kv_first=kv_first)
    sources = [7, 2, 9, 0, 5, 11][: 2 * factor]  # scattered GPU blocks: two offloaded blocks
    targets = [1, 10, 3, 6, 8, 4][: 2 * factor]
    rows = [5, 2]
    halves = range(1 + kv_first)
    before = {
        (layer, b, half): rig.page(layer, b, half) for layer in range(3) for b in sources for half in halves
    }

    rig.scramble(seed=1, gpu=False)  # a sentinel in every CPU byte, padding included
    rig.transfer(1, sources, [len(sources)], rows, store=True)  # checks every byte of both sides
    rig.scramble(seed=2, region=False)  # a fresh sentinel in every GPU byte
    rig.transfer(2, targets, [len(targets)], rows, store=False)
    for layer in range(3):
        for half in halves:
            for source, target in zip(sources, targets):
                np.testing.assert_array_equal(rig.page(layer, target, half), before[(layer, source, half)])


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
def test_load_from_the_middle_of_an_offloaded_block(device, rigs, kv_first):
    rig = rigs(device, factor=3, kv_first=kv_first)
    stored = [0, 1, 2, 3, 4, 5]  # logical blocks 3..8 of a request: offloaded blocks 1 and 2
    before = {
        (layer, b, half): rig.page(layer, b, half)
        for layer in range(3)
        for b in stored
        for half in range(1 + kv_first)
    }
    rig.transfer(1, stored, [6], [4, 2], block_indices=[3], store=True)
    # the engine already holds logical blocks 0..3; it loads 4..7: page 1 of row 4 onwards,
    # ending one page before row 2's end
    targets = [9, 11, 6, 10]
    rig.transfer(2, targets, [4], [4, 2], block_indices=[4], store=False)
    for layer in range(3):
        for half in range(1 + kv_first):
            for logical, target in zip(range(4, 8), targets):
                np.testing.assert_array_equal(
                    rig.page(layer, target, half), before[(layer, stored[logical - 3], half)]
                )


def test_groups_including_an_empty_one(device, rigs):
    # group 0: layers 0 and 1; group 1: no layers at all; group 2: layer 2
    rig = rigs(device, factor=2, groups=[[0, 1], [], [2]], num_rows=10)
    before = {(layer, b): rig.page(layer, b) for layer in range(3) for b in range(12)}
    # group 1 (no layers) still takes its CPU row; group 2 sends nothing this time (size 0)
    rig.transfer(1, [0, 1, 2, 3, 4, 5], [4, 2, 0], [7, 3, 0], block_indices=[0, 2, 4], store=True)
    rig.transfer(2, [6, 7, 8, 9], [2, 0, 2], [3, 9], block_indices=[2, 0, 0], store=True)
    # load back: group 0 from rows 7 and 3 skipping one page; group 2 from row 9
    rig.transfer(3, [10, 11, 5, 1, 0], [3, 0, 2], [7, 3, 9], block_indices=[1, 0, 0], store=False)
    # rows 7, 3 held blocks 0,1 | 2,3 of group 0 (layers 0, 1); row 3 was then overwritten by
    # job 2's group 0 (blocks 6, 7); row 9 holds blocks 8, 9 of layer 2
    for layer in (0, 1):
        np.testing.assert_array_equal(rig.page(layer, 10), before[(layer, 1)])
        np.testing.assert_array_equal(rig.page(layer, 11), before[(layer, 6)])
        np.testing.assert_array_equal(rig.page(layer, 5), before[(layer, 7)])
    np.testing.assert_array_equal(rig.page(2, 1), before[(2, 8)])
    np.testing.assert_array_equal(rig.page(2, 0), before[(2, 9)])


def test_shared_tensor_groups_copy_their_own_page_sizes(device, rigs):
    # a hybrid-style cache: both groups use every tensor, group 1 only the first half of a page
    rig = rigs(device, factor=1, groups=[[0, 1, 2], [0, 1, 2]])
    for refs in rig.kv.group_data_refs[1]:
        refs.page_size_bytes //= 2
    rig.handlers.shutdown()
    engine = device.partition("+")[2] or "auto"  # the same engine as the rig's
    rig.handlers = CpuGpuOffloadingHandlers(rig.kv, rig.region, 1, engine=engine)
    rig.store_handler, rig.load_handler = (
        rig.handlers.gpu_to_cpu_handler,
        rig.handlers.cpu_to_gpu_handler,
    )
    rig.transfer(1, [3, 4, 5], [1, 2], [0, 1, 2], store=True)
    rig.transfer(2, [0, 1, 2], [2, 1], [1, 2, 0], store=False)


def test_region_attached_by_path_from_another_object(device, rigs):
    with SharedRegion.create(8, 3 * 4 * 6 * 2) as creator:  # 3 layers of 4x6 bf16 pages
        rig = rigs(device, region=SharedRegion.attach(creator.path))
        assert rig.region is not creator and not rig.region.is_creator
        rig.transfer(1, [3, 8], [2], [6, 1], store=True)
        # the creator's mapping sees the same bytes
        for row, block in ((6, 3), (1, 8)):
            expected = np.concatenate([rig.page(layer, block) for layer in range(3)])
            np.testing.assert_array_equal(creator.rows[row], expected)
        creator.rows[4] = creator.rows[6]
        rig.transfer(2, [0], [1], [4], store=False)
        for layer in range(3):
            np.testing.assert_array_equal(rig.page(layer, 0), rig.page(layer, 3))


# ---------------------------------------------------------------------------------------------
# order, waiting, failures


def test_completions_come_in_submission_order(device, rigs):
    rig = rigs(device, num_blocks=16, num_rows=16)
    store = rig.store_handler
    jobs = list(range(100, 110))
    for i, job in enumerate(jobs):
        count = 1 + (i * 7) % 5  # mixed sizes, so later jobs are often smaller
        assert store.transfer_async(job, rig.specs(list(range(count)), [count], list(range(i, i + count))))
    seen = []
    while len(seen) < len(jobs):
        seen += store.get_finished()
        if len(seen) < len(jobs):
            store.wait({jobs[len(seen)]})
    assert [r.job_id for r in seen] == jobs
    assert all(r.success for r in seen)
    assert store.get_finished() == []


def test_a_failed_job_is_reported_and_later_jobs_complete_in_order(device, rigs, caplog):
    rig = rigs(device)
    failing_after(rig.store_handler.engine, calls_ok=1)
    with caplog.at_level(logging.WARNING, logger="kvtier.worker.engines"):
        for job, block in ((1, 0), (2, 1), (3, 2)):
            assert rig.store_handler.transfer_async(job, rig.specs([block], [1], [block]))
        rig.store_handler.wait({1, 2, 3})
        results = rig.store_handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert results[1].transfer_size == 0
    assert rig.store_handler.engine.failed_jobs == 1
    messages = [r.getMessage() for r in caplog.records if "job 2 failed" in r.getMessage()]
    assert len(messages) == 1 and "injected copy failure" in messages[0]
    # job 3 really ran after the failure
    expected = np.concatenate([rig.page(layer, 2) for layer in range(3)])
    np.testing.assert_array_equal(rig.region.rows[2], expected)


def test_wait_returns_only_when_the_named_jobs_are_done(rigs):
    rig = rigs("cpu")
    engine = rig.store_handler.engine
    gate = threading.Event()
    original = engine.copy

    def gated(*descriptors):
        assert gate.wait(30)
        original(*descriptors)

    engine.copy = gated
    assert rig.store_handler.transfer_async(1, rig.specs([4], [1], [0]))
    waiter = threading.Thread(target=rig.store_handler.wait, args=({1},))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "wait() returned while the job was still blocked"
    assert rig.store_handler.get_finished() == []
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive()
    results = rig.store_handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    expected = np.concatenate([rig.page(layer, 4) for layer in range(3)])
    np.testing.assert_array_equal(rig.region.rows[0], expected)


def test_wait_ignores_unknown_and_finished_jobs(device, rigs):
    rig = rigs(device)
    rig.transfer(1, [0], [1], [0], store=True)
    rig.store_handler.wait({1, 99})  # 1 already reported, 99 never existed: no hang, no error
    rig.load_handler.wait({1})


# ---------------------------------------------------------------------------------------------
# malformed specs and configuration errors


@pytest.mark.parametrize(
    "make_spec, match",
    [
        (
            lambda: (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1])),
            "copies GPULoadStoreSpec -> CPULoadStoreSpec",
        ),
        (lambda: (GPULoadStoreSpec([0, 1], [2]), CPULoadStoreSpec([0])), "needs 2 CPU blocks"),
        (lambda: (GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([0, 1])), "names 2"),
        (lambda: (GPULoadStoreSpec([0, 1], [1, 1]), CPULoadStoreSpec([0, 1])), "groups"),
        (lambda: (GPULoadStoreSpec([99], [1]), CPULoadStoreSpec([0])), "GPU block ids"),
        (lambda: (GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([8])), "CPU block ids"),
        (lambda: (GPULoadStoreSpec([0], [1]),), "pair"),
        (lambda: "not a spec", "pair"),
    ],
)
def test_malformed_spec_raises_and_queues_nothing(device, rigs, make_spec, match):
    rig = rigs(device)
    before = rig.snapshot()
    with pytest.raises(ValueError, match=match):
        rig.store_handler.transfer_async(1, make_spec())
    rig.store_handler.wait({1})
    assert rig.store_handler.get_finished() == []
    rig.assert_bytes(before)
    # the handler is still usable, and job id 1 is free
    rig.transfer(1, [0], [1], [0], store=True)


def test_job_id_in_flight_is_refused(rigs):
    rig = rigs("cpu")
    gate = threading.Event()
    original = rig.store_handler.engine.copy
    rig.store_handler.engine.copy = lambda *d: (gate.wait(30), original(*d))
    assert rig.store_handler.transfer_async(5, rig.specs([0], [1], [0]))
    with pytest.raises(ValueError, match="still in flight"):
        rig.store_handler.transfer_async(5, rig.specs([1], [1], [1]))
    gate.set()
    rig.store_handler.wait({5})
    assert [r.job_id for r in rig.store_handler.get_finished()] == [5]


def test_shutdown_drains_then_refuses(device, rigs):
    rig = rigs(device)
    assert rig.store_handler.transfer_async(1, rig.specs([3], [1], [2]))
    rig.store_handler.shutdown()
    assert [(r.job_id, r.success) for r in rig.store_handler.get_finished()] == [(1, True)]
    assert rig.store_handler.transfer_async(2, rig.specs([3], [1], [2])) is False
    expected = np.concatenate([rig.page(layer, 3) for layer in range(3)])
    np.testing.assert_array_equal(rig.region.rows[2], expected)


def test_region_is_closed_once_both_handlers_stop_when_owned(torch_device):
    layers = [torch.zeros((4, 64), dtype=torch.int8, device=torch_device)]
    region = SharedRegion.create(2, 64)
    handlers = CpuGpuOffloadingHandlers(canonicalize(layers), region, 1, owns_region=True)
    handlers.gpu_to_cpu_handler.shutdown()
    assert not region.closed
    handlers.cpu_to_gpu_handler.shutdown()
    assert region.closed


def test_region_row_size_must_match_the_layout(torch_device):
    layers = [torch.zeros((4, 64), dtype=torch.int8, device=torch_device)]
    with (
        SharedRegion.create(2, 100) as region,
        pytest.raises(ConfigError, match="region.row_bytes: got 100; expected 192"),
    ):
        CpuGpuOffloadingHandlers(canonicalize(layers), region, 3)


def test_page_size_must_match_the_tensor(torch_device):
    kv = canonicalize([torch.zeros((4, 64), dtype=torch.int8, device=torch_device)])
    kv.tensors[0].page_size_bytes = 48
    with (
        SharedRegion.create(2, 48) as region,
        pytest.raises(ConfigError, match=r"kv_caches.tensors\[0\]"),
    ):
        CpuGpuOffloadingHandlers(kv, region, 1)


def test_engine_must_fit_the_device(torch_device):
    layers = [torch.zeros((4, 64), dtype=torch.int8, device=torch_device)]
    for wrong in ("cuda", "kernel") if torch_device == "cpu" else ("thread",):
        with SharedRegion.create(2, 64) as region, pytest.raises(ValueError, match="engine"):
            CpuGpuOffloadingHandlers(canonicalize(layers), region, 1, engine=wrong)


# ---------------------------------------------------------------------------------------------
# CUDA only: the stream dependencies


def test_cuda_store_waits_for_the_compute_stream(rigs, cuda_engine):
    rig = rigs(cuda_engine)
    compute = torch.cuda.current_stream()
    rig.layers[0][6].fill_(3)  # the fill kernel's first launch (a module load) comes first
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s) ...
    rig.layers[0][5].fill_(3)  # ... then write KV the store must see
    assert rig.store_handler.transfer_async(1, rig.specs([5], [1], [0]))
    assert rig.store_handler.get_finished() == []  # queued behind the compute stream
    rig.store_handler.wait({1})
    assert [(r.job_id, r.success) for r in rig.store_handler.get_finished()] == [(1, True)]
    assert compute.query()
    np.testing.assert_array_equal(rig.region.rows[0][: rig.page(0, 5).size], rig.page(0, 5))
    assert (rig.page(0, 5).view(np.uint8) != 0).any()


def test_cuda_submitting_never_waits_for_the_compute_stream(rigs, cuda_engine):
    # transfer_async runs on the model's thread: it must enqueue and return, not block until
    # the model's queued work is done (a pageable staging copy would, or a lazy compile).
    rig = rigs(cuda_engine)
    rig.transfer(1, [0, 1], [2], [0, 1], store=True)  # first use of each direction
    rig.transfer(2, [2, 3], [2], [0, 1], store=False)
    # jobs of sizes not seen before, so nothing sized per job can come from a cache
    copies = model_copies(rig.kv, 1, rig.region.row_stride, [4, 5, 6], [3], None, [2, 3, 4])
    _, region_after = rig.expected_after(copies, True)
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of compute-stream work
    assert rig.store_handler.transfer_async(3, rig.specs([4, 5, 6], [3], [2, 3, 4]))
    assert rig.load_handler.transfer_async(4, rig.specs([8], [1], [0], store=False))
    assert not compute.query()  # both submits returned while the model's work still ran
    rig.store_handler.wait({3})
    rig.load_handler.wait({4})
    assert [(r.job_id, r.success) for r in rig.store_handler.get_finished()] == [(3, True)]
    assert [(r.job_id, r.success) for r in rig.load_handler.get_finished()] == [(4, True)]
    np.testing.assert_array_equal(rig.region_bytes(), region_after)
    assert all(torch.equal(layer[8], layer[0]) for layer in rig.layers)  # row 0 came back


def test_cuda_copies_run_on_streams_of_their_own(rigs, cuda_engine):
    # torch's streams are a shared pool of 32 per priority, and vLLM computes on one of them:
    # the engine's copy streams are made through the driver, so none can be the model's
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        rig = rigs(cuda_engine)
        pool = [torch.cuda.Stream() for _ in range(64)]  # go round torch's pool twice
        for job in range(1, 5):
            rig.transfer(job, [job], [1], [job], store=job % 2 == 1)
    for engine in (rig.store_handler.engine, rig.load_handler.engine):
        assert engine._streams
        # made through the driver (torch's own would be plain torch.cuda.Stream objects)
        assert all(isinstance(stream, torch.cuda.ExternalStream) for stream in engine._streams)
        handles = {stream.cuda_stream for stream in engine._streams}
        assert compute.cuda_stream not in handles
        assert not handles & {stream.cuda_stream for stream in pool}


def test_cuda_engines_come_and_go_on_the_same_streams(cuda_engine):
    # Streams are never destroyed (torch's pinned-memory cache may record events on them
    # after an engine is gone): an engine that shuts down gives them back to the next one.
    from kvtier.worker.engines import cuda as cuda_engines

    def pooled() -> set[int]:
        return {s.cuda_stream for streams in cuda_engines._stream_pool.values() for s in streams}

    Rig(cuda_engine.partition("+")[0], engine=cuda_engine.partition("+")[2] or "auto").close()
    before = pooled()
    for round_ in range(3):
        rig = Rig(cuda_engine.partition("+")[0], engine=cuda_engine.partition("+")[2] or "auto")
        rig.transfer(1, [round_], [1], [round_], store=True)
        rig.transfer(2, [round_ + 4], [1], [round_], store=False)
        rig.close()
        del rig
        gc.collect()  # the engines' pinned and device buffers are freed here
        torch.cuda.synchronize()
    assert before and pooled() == before


def test_cuda_a_store_never_stalls_the_compute_stream(rigs, cuda_engine):
    # A store of 256 MiB (about 10 ms over PCIe) is in flight; work the model enqueues on the
    # compute stream after it starts must not wait for it.
    rig = rigs(cuda_engine, layers=4, num_blocks=40, block_shape=(1024, 1024), num_rows=32)
    compute = torch.cuda.current_stream()
    assert rig.store_handler.transfer_async(1, rig.specs(list(range(32)), [32], list(range(32))))
    marker = torch.cuda.Event()
    marker.record(compute)
    marker.synchronize()  # the compute stream got past its own work at once ...
    assert rig.store_handler.get_finished() == []  # ... while the store still runs
    rig.store_handler.wait({1})
    assert [(r.job_id, r.success) for r in rig.store_handler.get_finished()] == [(1, True)]
    np.testing.assert_array_equal(rig.region.rows[31][: rig.page(0, 31).size], rig.page(0, 31))


def test_cuda_a_finished_load_is_visible_to_the_next_kernel(rigs, cuda_engine):
    rig = rigs(cuda_engine, block_shape=(64, 64))
    rig.transfer(1, [0, 1, 2, 3], [4], [0, 1, 2, 3], store=True)
    want = [layer[[0, 1, 2, 3]].clone() for layer in rig.layers]
    for layer in rig.layers:
        layer[[8, 9, 10, 11]] = 0
    assert rig.load_handler.transfer_async(2, rig.specs([8, 9, 10, 11], [4], [0, 1, 2, 3], store=False))
    results, deadline = [], time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        results = rig.load_handler.get_finished()  # as a scheduler learns it: polling, no sync
    assert [(r.job_id, r.success) for r in results] == [(2, True)]
    # the very next work on the compute stream reads the loaded blocks
    got = [layer[[8, 9, 10, 11]].clone() for layer in rig.layers]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_cuda_loads_run_at_higher_priority_than_stores(rigs):
    rig = rigs("cuda")
    for job, handler in ((1, rig.store_handler), (2, rig.load_handler)):
        spec = rig.specs([0], [1], [0], store=handler is rig.store_handler)
        assert handler.transfer_async(job, spec)
        handler.wait({job})
        assert handler.get_finished()[0].success
    store_stream = rig.store_handler.engine._streams[0]
    load_stream = rig.load_handler.engine._streams[0]
    assert load_stream.priority < store_stream.priority


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.cuda_available(), reason="needs CUDA")
def test_cuda_fallback_copies_match(rigs):
    rig = rigs("cuda", factor=3)
    for engine in (rig.store_handler.engine, rig.load_handler.engine):
        engine._batch = None  # force one cudaMemcpyAsync per segment
    sources = [0, 1, 2, 7, 8, 9]
    rig.transfer(1, sources, [6], [3, 0], store=True)
    rig.transfer(2, [3, 4, 5, 10, 11, 6], [6], [3, 0], store=False)

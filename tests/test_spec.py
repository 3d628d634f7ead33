"""TieredOffloadingSpec: geometry from config, both sides wired, bytes through the whole stack."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from kvtier_testing import key

import kvtier
from kvtier import (
    ConfigError,
    KvtierError,
    OffloadingSpec,
    ReqContext,
    TieredOffloadingSpec,
)
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec

CTX = ReqContext("req-1")


def cpu_config(**extra):
    tier = {"kind": "cpu", "capacity": "1MiB", "pin_memory": "auto", **extra}
    return {"tiers": [tier]}


@pytest.fixture
def specs():
    made = []

    def make(config, **kwargs):
        spec = TieredOffloadingSpec(config, **kwargs)
        made.append(spec)
        return spec

    yield make
    for spec in made:
        spec.shutdown()


def kv_caches(pages, num_blocks=8, seed=0):
    torch = pytest.importorskip("torch")
    from kvtier.worker.canonical import canonicalize

    generator = torch.Generator().manual_seed(seed)
    layers = [
        torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=generator) for page in pages
    ]
    return layers, canonicalize(layers)


def test_is_exported_and_is_an_offloading_spec():
    assert kvtier.TieredOffloadingSpec is TieredOffloadingSpec
    assert "TieredOffloadingSpec" in kvtier.__all__
    assert issubclass(TieredOffloadingSpec, OffloadingSpec)


def test_import_kvtier_does_not_import_torch():
    code = (
        "import sys, kvtier\n"
        "spec = kvtier.TieredOffloadingSpec("
        "{'tiers': [{'kind': 'cpu', 'capacity': '1MiB'}]}, gpu_block_size_tokens=16, page_bytes=[4096])\n"
        "manager = spec.get_manager()\n"
        "manager.shutdown()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("tokens, factor", [(None, 1), (16, 1), (48, 3), (256, 16)])
def test_block_size_factor_and_block_bytes(specs, tokens, factor):
    config = {**cpu_config(), **({"block_size_tokens": tokens} if tokens else {})}
    spec = specs(config, gpu_block_size_tokens=16, page_bytes=[1024, 2048])
    assert spec.block_size_factor == factor
    assert spec.block_bytes == factor * 3072


def test_block_size_tokens_must_be_a_multiple(specs):
    with pytest.raises(
        ConfigError,
        match=r"block_size_tokens: got 40; expected a multiple of .*\(16 tokens\). Fix: use 32",
    ):
        specs({**cpu_config(), "block_size_tokens": 40}, gpu_block_size_tokens=16, page_bytes=[64])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"gpu_block_size_tokens": 0, "page_bytes": [64]}, "gpu_block_size_tokens"),
        ({"gpu_block_size_tokens": 16, "page_bytes": []}, "page_bytes"),
        ({"gpu_block_size_tokens": 16, "page_bytes": [64, 0]}, r"page_bytes\[1\]"),
        ({"gpu_block_size_tokens": 16, "page_bytes": 64}, "page_bytes"),
    ],
)
def test_bad_layout_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TieredOffloadingSpec(cpu_config(), **kwargs)


def test_spec_picks_a_region_path_when_the_config_has_none(specs):
    a = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64])
    b = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64])
    assert a.region_path != b.region_path
    assert os.path.basename(a.region_path).startswith("kvtier-")
    assert a.config.tiers[0].path == a.region_path
    assert not os.path.exists(a.region_path)  # created by get_manager, not before


def test_explicit_region_path_is_kept(specs, tmp_path):
    path = str(tmp_path / "region")
    spec = specs(cpu_config(path=path), gpu_block_size_tokens=16, page_bytes=[64])
    assert spec.region_path == path
    spec.get_manager()
    assert os.path.exists(path)


def test_manager_side_never_pins_and_is_built_once(specs):
    spec = specs(cpu_config(pin_memory="on"), gpu_block_size_tokens=16, page_bytes=[4096])
    manager = spec.get_manager()  # pin_memory on, yet no CUDA needed on the scheduler side
    assert spec.get_manager() is manager
    assert os.path.exists(spec.region_path)
    out = manager.prepare_store([key(1)], CTX)
    assert out is not None and out.store_spec.medium() == "CPU"


def test_pin_memory_on_fails_on_the_worker_without_cuda(specs):
    from kvtier import cuda

    if cuda.cuda_available():
        pytest.skip("this machine can pin")
    spec = specs(cpu_config(pin_memory="on"), gpu_block_size_tokens=16, page_bytes=[4096])
    spec.get_manager()
    _, kv = kv_caches([4096])
    with pytest.raises(KvtierError, match="pin_memory is 'on'"):
        list(spec.get_handlers(kv))


def test_page_sizes_must_match_the_engine(specs):
    spec = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64, 128])
    spec.get_manager()
    _, kv = kv_caches([64, 64])
    with pytest.raises(ConfigError, match=r"page_bytes: got \[64, 128\]; expected .* \[64, 64\]"):
        list(spec.get_handlers(kv))


def test_get_handlers_gives_up_when_no_region_appears(specs):
    spec = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64], attach_timeout_s=0.2)
    _, kv = kv_caches([64])
    with pytest.raises(KvtierError, match=r"could not be attached within 0.2 s.*get_manager\(\)"):
        list(spec.get_handlers(kv))


def test_get_handlers_waits_for_the_scheduler_side(specs):
    scheduler = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64])
    worker = specs(scheduler.config, gpu_block_size_tokens=16, page_bytes=[64], attach_timeout_s=30)
    assert worker.region_path == scheduler.region_path
    layers, kv = kv_caches([64])
    assert not os.path.exists(scheduler.region_path)
    timer = threading.Timer(0.3, scheduler.get_manager)
    timer.start()
    try:
        handlers = list(worker.get_handlers(kv))  # blocks until the region appears
    finally:
        timer.join()
    assert [(src.medium(), dst.medium()) for src, dst, _ in handlers] == [
        ("GPU", "CPU"),
        ("CPU", "GPU"),
    ]
    store = handlers[0][2]
    assert store.transfer_async(1, (GPULoadStoreSpec([3], [1]), CPULoadStoreSpec([2])))
    store.wait({1})
    assert store.get_finished()[0].success
    # the worker attached to the region the scheduler side created
    np.testing.assert_array_equal(
        scheduler.get_manager().backend.rows[2], layers[0][3].numpy().view(np.uint8)
    )


@pytest.mark.parametrize("tokens", [None, 32])
def test_bytes_go_through_manager_and_handlers_and_come_back(specs, tokens):
    from kvtier.worker.worker import OffloadingWorker

    pages = [256, 512, 256]
    config = {**cpu_config(), **({"block_size_tokens": tokens} if tokens else {})}
    spec = specs(config, gpu_block_size_tokens=16, page_bytes=pages)
    factor = spec.block_size_factor
    manager = spec.get_manager()  # the scheduler process
    layers, kv = kv_caches(pages, num_blocks=12)
    worker = OffloadingWorker.from_spec(spec, kv)  # a worker process (here the same one)

    keys = [key(i) for i in range(3)]
    sources = [5, 0, 7, 9, 2, 11][: 3 * factor] if factor > 1 else [5, 0, 7]
    originals = [layer[sources].clone() for layer in layers]
    out = manager.prepare_store(keys, CTX)
    assert out.keys_to_store == keys
    assert worker.transfer_async(1, (GPULoadStoreSpec(sources, [len(sources)]), out.store_spec))
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    manager.complete_store(keys, CTX)
    assert all(manager.lookup(k, CTX) for k in keys)

    # the scheduler side's mapping holds exactly the stored bytes, in the row layout
    rows = manager.backend.rows  # the scheduler side's own mapping of the region
    for i, row in enumerate(out.store_spec.block_ids):
        parts = []
        for layer in originals:
            parts.append(layer[i * factor : (i + 1) * factor].numpy().view(np.uint8).ravel())
        np.testing.assert_array_equal(rows[row], np.concatenate(parts))

    for layer in layers:
        layer.zero_()
    load_spec = manager.prepare_load(keys, CTX)
    targets = [1, 3, 4, 6, 8, 10][: len(sources)]
    assert worker.transfer_async(2, (load_spec, GPULoadStoreSpec(targets, [len(targets)])))
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    manager.complete_load(keys, CTX)
    for layer, original in zip(layers, originals):
        np.testing.assert_array_equal(layer[targets].numpy(), original.numpy())
    worker.shutdown()


def test_shutdown_releases_both_sides(specs):
    spec = specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[64])
    spec.get_manager()
    _, kv = kv_caches([64])
    handlers = [h for _, _, h in spec.get_handlers(kv)]
    spec.shutdown()
    assert not os.path.exists(spec.region_path)
    assert handlers[0].transfer_async(1, (GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([0]))) is False
    spec.shutdown()  # idempotent


def test_parallel_ranks_share_one_row_of_every_shard(specs, tmp_path):
    path = str(tmp_path / "region")
    config = {"tiers": [{"kind": "cpu", "capacity": "1MiB", "path": path, "pin_memory": "off"}]}
    spec = specs(config, gpu_block_size_tokens=16, page_bytes=[4096, 8192], world_size=4, rank=3)
    assert spec.shard.offset == 3 * 12288 and spec.block_bytes == 4 * 12288
    mla = specs(config, gpu_block_size_tokens=16, page_bytes=[4096], world_size=4, kv_replicas=4)
    assert mla.block_bytes == 4096 and mla.shard.writes
    # the fingerprint names the world size and shard layout, so TP=2 and TP=4 rows never mix
    tp2 = specs(config, gpu_block_size_tokens=16, page_bytes=[8192], world_size=2)
    tp4 = specs(config, gpu_block_size_tokens=16, page_bytes=[4096], world_size=4)
    assert tp2.block_bytes == tp4.block_bytes and tp2.fingerprint() != tp4.fingerprint()
    assert tp2.fingerprint().world_size == 2
    # ... unless every rank holds the same bytes (MLA): that row is the same at any TP size
    mla2 = specs(config, gpu_block_size_tokens=16, page_bytes=[4096], world_size=2, kv_replicas=2)
    assert mla.fingerprint() == mla2.fingerprint() and mla.fingerprint().world_size == 1


def test_parallel_ranks_need_a_region_path_they_all_know(specs):
    with pytest.raises(ConfigError, match=r"tiers\[0\].path"):
        specs(cpu_config(), gpu_block_size_tokens=16, page_bytes=[4096], world_size=2, rank=1)

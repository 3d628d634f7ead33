"""A tier kind from outside kvtier (tests/outside/remote_tier.py), configured from YAML only.

Nothing inside kvtier names it: the YAML names its section class by class path (or by class
name and ``module_path``), and the same stack then serves ``kvtier replay`` and a
``TieredOffloadingSpec`` with real bytes, compared byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvtier_testing import key

from kvtier import ConfigError, ReqContext, TieredOffloadingSpec, load_config
from kvtier.config import TIER_KINDS, describe
from kvtier.mediums import GPULoadStoreSpec

OUTSIDE = Path(__file__).resolve().parents[1] / "outside"
CTX = ReqContext("req-1")


@pytest.fixture
def remote(monkeypatch):
    """The out-of-tree module importable (as a user's package would be), with empty buckets."""
    monkeypatch.syspath_prepend(str(OUTSIDE))
    import remote_tier

    remote_tier.BUCKETS.clear()
    yield remote_tier
    remote_tier.BUCKETS.clear()


def stack_yaml(cpu_capacity: str, remote: str, write_policy: str = "write_back") -> str:
    return (
        "tiers:\n"
        f"  - {{name: cpu, kind: cpu, capacity: {cpu_capacity}, pin_memory: off}}\n"
        f"  - {{name: far, {remote}, capacity: 64MiB, eviction: arc}}\n"
        f"cascade: {{write_policy: {write_policy}}}\n"
    )


def test_the_kind_is_not_registered_in_kvtier(remote):
    assert "remote_tier" not in str(TIER_KINDS.names()) and "RemoteTierConfig" not in TIER_KINDS


@pytest.mark.parametrize(
    "remote_keys",
    [
        "kind: 'remote_tier:RemoteTierConfig', url: 'mem://a'",
        "kind: RemoteTierConfig, module_path: remote_tier, url: 'mem://a'",
    ],
    ids=["class path", "module_path"],
)
def test_yaml_names_the_kind_by_class_path_or_module_path(remote, remote_keys):
    config = load_config(stack_yaml("1MiB", remote_keys + ", batch_blocks: 8"))
    far = config.tiers[1]
    assert type(far) is remote.RemoteTierConfig
    assert (far.url, far.batch_blocks, far.eviction, far.capacity_bytes) == ("mem://a", 8, "arc", 64 << 20)
    text = describe(config)
    assert "mem://a" in text and "batch_blocks=8" in text


@pytest.mark.parametrize(
    "remote_keys, field, expected",
    [
        ("kind: 'remote_tier:RemoteTierConfig'", "tiers[1].url", "got <missing>"),
        ("kind: 'remote_tier:RemoteTierConfig', url: 'http://x'", "tiers[1].url", "mem://"),
        (
            "kind: 'remote_tier:RemoteTierConfig', url: 'mem://a', path: /x",
            "tiers[1].path",
            "applies only to tiers of kind cpu",
        ),
        (
            "kind: 'remote_tier:RemoteTierConfig', url: 'mem://a', batch_blocks: 0",
            "tiers[1].batch_blocks",
            ">= 1",
        ),
        ("kind: 'remote_tier:Missing', url: 'mem://a'", "tiers[1].kind", "TierConfig subclass"),
        ("kind: 'remote_tier:RemoteTier', url: 'mem://a'", "tiers[1].kind", "TierConfig subclass"),
        ("kind: RemoteTierConfig, module_path: no_such_mod_kvtier", "tiers[1].module_path", "importable"),
        ("kind: remote, url: 'mem://a'", "tiers[1].kind", "class path module:Class"),
    ],
)
def test_errors_name_the_field_of_the_out_of_tree_kind(remote, remote_keys, field, expected):
    with pytest.raises(ConfigError) as info:
        load_config(stack_yaml("1MiB", remote_keys))
    assert info.value.field == field and expected in str(info.value)


def test_it_serves_kvtier_replay(remote, tmp_path, capsys):
    from kvtier.cli.main import main

    config = tmp_path / "stack.yaml"
    # a CPU tier of 600 blocks: most reuse of the trace's slice must come back from below
    config.write_text(
        stack_yaml(str(600 * 4096), "kind: 'remote_tier:RemoteTierConfig', url: 'mem://replay'")
    )
    argv = [
        "replay",
        "--config",
        str(config),
        "--limit",
        "150",
        "--gpu-blocks",
        "400",
        "--block-bytes",
        "4096",
        "--no-progress",
        "--no-baseline",
        "--json",
    ]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tiers"] == ["cpu:cpu", "far:remote_tier:RemoteTierConfig"]
    assert record["hits"]["far"] > 0 and record["promotions"] > 0 and record["demotions"] > 0
    assert record["mismatched_blocks"] == 0 and record["verified_blocks"] > 0
    assert len(remote.BUCKETS["mem://replay"]) > 0


def test_it_serves_a_tiered_offloading_spec(remote):
    torch = pytest.importorskip("torch")
    from kvtier.worker.canonical import canonicalize
    from kvtier.worker.worker import OffloadingWorker

    pages = [256, 512]
    yaml_text = stack_yaml(
        "1MiB",
        "kind: RemoteTierConfig, module_path: remote_tier, url: 'mem://spec'",
        write_policy="write_through",
    )
    spec = TieredOffloadingSpec(yaml_text, gpu_block_size_tokens=16, page_bytes=pages)
    try:
        manager = spec.get_manager()
        layers = [
            torch.randint(-128, 128, (8, p), dtype=torch.int8, generator=torch.Generator().manual_seed(p))
            for p in pages
        ]
        worker = OffloadingWorker.from_spec(spec, canonicalize(layers))
        keys = [key(i) for i in range(3)]
        sources = [5, 0, 7]
        originals = [layer[sources].clone() for layer in layers]
        out = manager.prepare_store(keys, CTX)
        assert worker.transfer_async(1, (GPULoadStoreSpec(sources, [3]), out.store_spec))
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_store(keys, CTX)
        manager.on_schedule_end()  # write_through: saved below
        manager.on_schedule_end()  # the save's result is polled
        assert set(remote.BUCKETS["mem://spec"]) == set(keys)

        manager.reset_cache()  # the CPU tier forgets: what comes back must come from the far tier
        for layer in layers:
            layer.zero_()
        manager.backend.rows[:] = 0
        assert [manager.lookup(k, CTX) for k in keys] == [None] * 3  # read queued
        for _ in range(3):
            manager.on_schedule_end()
            if all(manager.lookup(k, CTX) for k in keys):
                break
        assert all(manager.lookup(k, CTX) is True for k in keys)
        load = manager.prepare_load(keys, CTX)
        targets = [1, 3, 4]
        assert worker.transfer_async(2, (load, GPULoadStoreSpec(targets, [3])))
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_load(keys, CTX)
        for layer, original in zip(layers, originals):
            np.testing.assert_array_equal(layer[targets].numpy(), original.numpy())
        assert manager.stats()["far.promotions"] == 3
        worker.shutdown()
    finally:
        spec.shutdown()


def test_a_damaged_remote_block_is_a_counted_miss(remote):
    """The kind's verification goes through the shared bookkeeping: dropped, counted, never served."""
    from kvtier import build_manager

    manager = build_manager(
        stack_yaml(
            "1MiB", "kind: 'remote_tier:RemoteTierConfig', url: 'mem://rot'", write_policy="write_through"
        ),
        block_bytes=4096,
    )
    try:
        from kvtier_testing import store_blocks

        store_blocks(manager, [key(1)], CTX)
        manager.on_schedule_end()
        manager.on_schedule_end()
        payload, digest = remote.BUCKETS["mem://rot"][key(1)]
        remote.BUCKETS["mem://rot"][key(1)] = (b"\x00" + payload[1:], digest)
        manager.reset_cache()
        assert manager.lookup(key(1), CTX) is None
        manager.on_schedule_end()
        manager.on_schedule_end()
        assert manager.lookup(key(1), CTX) is False
        stats = manager.stats()
        assert stats["far.corrupt_blocks"] == 1 and stats["far.corrupt_digest"] == 1
    finally:
        manager.shutdown()

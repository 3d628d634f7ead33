"""The settings in examples/vllm/ build what they promise in vLLM 0.33 (paths and sizes scaled
down where building would allocate them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_support import TOKENS_PER_BLOCK, offloading_config

from kvtier.integrations.vllm import KvtierDiskTier, TieredOffloadingSpec
from kvtier.integrations.vllm.disk_tier import parse_disk_tier_entry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "vllm"


def extra_config(name: str) -> dict:
    transfer = json.loads((EXAMPLES / name).read_text())
    assert (transfer["kv_connector"], transfer["kv_role"]) == ("OffloadingConnector", "kv_both")
    return transfer["kv_connector_extra_config"]


def test_the_full_stack_example_builds_kvtiers_spec(monkeypatch):
    monkeypatch.chdir(ROOT)  # kvtier_config is relative to where vllm serve runs
    extra = extra_config("kvtier-spec.json")
    chunk = extra["block_size"] // TOKENS_PER_BLOCK  # what vLLM derives from block_size
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, blocks_per_chunk=chunk))
    assert isinstance(spec, TieredOffloadingSpec)
    layout = spec.layout
    assert [(t.name, t.kind) for t in layout.config.tiers] == [("cpu", "cpu"), ("nvme", "lmdb")]
    assert layout.config.block_size_tokens == extra["block_size"]
    assert layout.stats_log_interval_s == extra["kvtier_stats_log_interval_s"]


def test_the_tiering_example_builds_vllms_tiering_with_kvtiers_disk_tier(tmp_path):
    extra = extra_config("tiering.json")
    (entry,) = extra["secondary_tiers"]
    parsed = parse_disk_tier_entry(entry)  # the entry exactly as written
    assert (parsed.name, parsed.kind, parsed.capacity_bytes) == ("nvme", "lmdb", 1 << 40)
    # built for real with a small CPU tier and a store under tmp_path
    extra["cpu_bytes_to_use"] = 1 << 20
    entry.update(path=str(tmp_path / "store"), capacity="16MiB")
    chunk = extra["block_size"] // TOKENS_PER_BLOCK
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, blocks_per_chunk=chunk))
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KvtierDiskTier)
        assert (tier.config.kind, tier.config.fsync, tier.config.o_direct) == (
            "lmdb",
            "batch",
            "auto",
        )
        assert tier.tier.fingerprint.tokens_per_block == extra["block_size"]
    finally:
        manager.shutdown()

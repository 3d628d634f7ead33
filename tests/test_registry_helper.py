"""The one registry helper behind eviction policies, tier kinds and copy engines."""

from __future__ import annotations

import pytest

from kvtier.config import TIER_KINDS, TierConfig
from kvtier.errors import ConfigError
from kvtier.policies import POLICIES, EvictionPolicy
from kvtier.registry import Registry
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.worker.engines import ENGINES, CopyEngine


def test_the_three_families_use_it():
    assert isinstance(POLICIES, Registry) and POLICIES.base is EvictionPolicy
    assert isinstance(TIER_KINDS, Registry) and TIER_KINDS.base is TierConfig
    assert isinstance(ENGINES, Registry) and ENGINES.base is CopyEngine
    assert TIER_KINDS.names() == ("cpu", "lmdb", "files", "valkey", "redis")
    assert TIER_KINDS.resolve("cpu", field="k") is CPUTierConfig
    assert TIER_KINDS.resolve("files", field="k") is DiskTierConfig


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError) as info:
        TIER_KINDS.resolve("tape", field="tiers[1].kind")
    assert info.value.field == "tiers[1].kind" and "cpu, lmdb, files, valkey, redis" in str(info.value)


def test_class_path_and_module_path_load_out_of_tree_classes():
    assert TIER_KINDS.resolve("kvtier.tiers.disk.config:DiskTierConfig", field="k") is DiskTierConfig
    assert TIER_KINDS.resolve("CPUTierConfig", "kvtier.tiers.cpu.config", field="t.kind") is CPUTierConfig
    with pytest.raises(ConfigError) as info:
        TIER_KINDS.resolve("X", "no_such_module_kvtier", field="tiers[2].kind")
    assert info.value.field == "tiers[2].module_path" and "importable" in str(info.value)
    with pytest.raises(ConfigError, match="TierConfig subclass"):
        TIER_KINDS.resolve("kvtier.config:KvtierConfig", field="k")


def test_register_adds_a_short_name():
    registry = Registry("tier kind", TierConfig, {}, module_key="module_path")
    registry.register("disk", "kvtier.tiers.disk.config:DiskTierConfig")
    assert "disk" in registry and registry.resolve("disk", field="k") is DiskTierConfig
    with pytest.raises(ValueError):
        registry.register("bad", "no colon")


def test_cli_choices_come_from_the_registry(monkeypatch):
    from kvtier.cli import main as cli

    monkeypatch.setattr(
        TIER_KINDS, "_entries", {**TIER_KINDS._entries, "nvme2": "kvtier.tiers.disk.config:DiskTierConfig"}
    )
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "disk", "--backend", "nvme2"])
    assert args.backend == "nvme2"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "disk", "--backend", "cpu"])  # not a disk kind

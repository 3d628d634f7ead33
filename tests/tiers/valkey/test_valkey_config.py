"""The valkey tier's configuration section (no server needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvtier.config import describe, load_config
from kvtier.errors import ConfigError
from kvtier.tiers.valkey.config import DEFAULT_MAX_INFLIGHT_BYTES, ValkeyTierConfig, parse

CPU = "  - {name: cpu, kind: cpu, capacity: 64MiB}\n"


def test_a_yaml_stack_with_a_valkey_tier():
    config = load_config(
        "tiers:\n"
        + CPU
        + "  - {name: nvme, kind: lmdb, path: /tmp/x, capacity: 1GiB}\n"
        + "  - {name: shared, kind: valkey, url: 'valkey://10.0.0.5:6379/0', namespace: llama,"
        + " ttl_s: 3600, timeout_s: 0.25, max_inflight_bytes: 64MiB}\n"
    )
    tier = config.tiers[2]
    assert isinstance(tier, ValkeyTierConfig)
    assert (tier.name, tier.kind, tier.url, tier.namespace) == (
        "shared",
        "valkey",
        "valkey://10.0.0.5:6379/0",
        "llama",
    )
    assert (tier.ttl_s, tier.timeout_s, tier.max_inflight_bytes) == (3600.0, 0.25, 64 << 20)
    assert tier.capacity_bytes == 0  # the server's maxmemory bounds it
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.url = "x"  # type: ignore[misc]
    assert "at=valkey://10.0.0.5:6379/0" in describe(config)


@pytest.mark.parametrize(
    "url", ["redis://h:6379", "valkeys://h:6380/2", "unix:///run/valkey.sock", "rediss://u:p@h:1/0"]
)
def test_urls_accepted(url):
    tier = parse({"kind": "redis", "url": url}, "tiers[1]")
    assert tier.url == url and tier.kind == "redis" and tier.name == "redis"
    assert tier.max_inflight_bytes == DEFAULT_MAX_INFLIGHT_BYTES and tier.ttl_s is None


def test_cluster_nodes():
    tier = parse({"kind": "valkey", "cluster_nodes": ["10.0.0.5:7000", "[::1]:7001", "node-c:7002"]}, "t")
    assert tier.cluster_nodes == ("10.0.0.5:7000", "[::1]:7001", "node-c:7002") and tier.url is None


@pytest.mark.parametrize(
    "section, field, fix_part",
    [
        ({"kind": "valkey"}, "tiers[1].url", "cluster_nodes"),
        ({"kind": "valkey", "url": "valkey://h:1", "cluster_nodes": ["h:1"]}, "tiers[1].url", "exactly one"),
        ({"kind": "valkey", "url": "http://h:1"}, "tiers[1].url", "valkey://host:6379/0"),
        ({"kind": "valkey", "url": "valkey://h:99999"}, "tiers[1].url", "valkey://host:6379/0"),
        ({"kind": "valkey", "url": "valkey://h:1/x"}, "tiers[1].url", "/0"),
        ({"kind": "valkey", "cluster_nodes": "h:1"}, "tiers[1].cluster_nodes", "cluster_nodes: ["),
        ({"kind": "valkey", "cluster_nodes": ["h"]}, "tiers[1].cluster_nodes[0]", "10.0.0.5:7000"),
        ({"kind": "valkey", "url": "valkey://h:1", "capacity": "1GiB"}, "tiers[1].capacity", "maxmemory"),
        ({"kind": "valkey", "url": "valkey://h:1", "eviction": "lru"}, "tiers[1].eviction", "allkeys-lru"),
        ({"kind": "valkey", "url": "valkey://h:1", "path": "/x"}, "tiers[1].path", "remove it"),
        ({"kind": "valkey", "url": "valkey://h:1", "ttl_s": 0}, "tiers[1].ttl_s", "1.5"),
        ({"kind": "valkey", "url": "valkey://h:1", "timeout_s": "1s"}, "tiers[1].timeout_s", "1.5"),
        (
            {"kind": "valkey", "url": "valkey://h:1", "max_inflight_bytes": 0},
            "tiers[1].max_inflight_bytes",
            "256MiB",
        ),
        ({"kind": "valkey", "url": "valkey://h:1", "namespace": "a b"}, "tiers[1].namespace", "llama3-8b"),
        ({"kind": "valkey", "url": "valkey://h:1", "urll": 1}, "tiers[1].urll", "did you mean 'url'"),
    ],
)
def test_bad_sections_name_field_and_fix(section, field, fix_part):
    with pytest.raises(ConfigError) as raised:
        parse(section, "tiers[1]")
    assert raised.value.field == field
    assert fix_part in (raised.value.fix or "") + raised.value.expected


def test_a_valkey_tier_cannot_head_the_stack():
    with pytest.raises(ConfigError, match="tiers\\[0\\].kind"):
        load_config("tiers:\n  - {kind: valkey, url: 'valkey://h:1'}\n")


def test_a_missing_client_is_a_config_error_with_the_fix(monkeypatch):
    import importlib.util

    import kvtier

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "valkey" else real(name, *a)
    )
    config = {
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB", "pin_memory": "off"},
            {"kind": "valkey", "url": "valkey://127.0.0.1:1/0"},
        ]
    }
    from kvtier.extras import install_hint

    with pytest.raises(ConfigError, match=re.escape(install_hint("valkey"))) as raised:
        kvtier.build_manager(config, block_bytes=4096)
    assert raised.value.field == "tiers[1].kind"

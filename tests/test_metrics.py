import socket
import urllib.request

import pytest

from kvtier.config import CascadeConfig
from kvtier.manager.stack import TierStackManager
from kvtier.metrics import StatsCollector, serve_metrics
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryTier
from kvtier.testing import MemoryBackend

prometheus_client = pytest.importorskip("prometheus_client")


def stack():
    backend = MemoryBackend(4, 64)
    return TierStackManager(backend, LRUPolicy(4), [MemoryTier("nvme", backend.rows, 8)], CascadeConfig())


def test_collector_labels_per_tier_counters():
    registry = prometheus_client.CollectorRegistry()
    registry.register(StatsCollector(lambda: {"free_blocks": 3, "nvme.promotions": 7, "nvme.blocks": 2}))
    assert registry.get_sample_value("kvtier_free_blocks", {"tier": "cpu"}) == 3
    assert registry.get_sample_value("kvtier_promotions", {"tier": "nvme"}) == 7
    assert registry.get_sample_value("kvtier_blocks", {"tier": "nvme"}) == 2


def test_serve_metrics_on_loopback_reads_live_stats():
    manager = stack()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve_metrics(manager, port)
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvtier_free_blocks{tier="cpu"} 4.0' in page
    assert 'kvtier_blocks{tier="nvme"} 0.0' in page


def test_what_the_policy_learnt_is_a_cpu_tier_figure():
    """chain's learnt share (and ARC's target) reach stats() and the exporter, labelled as
    the CPU tier's, and follow the policy as it changes its mind."""
    from kvtier.policies.arc import ARCPolicy
    from kvtier.policies.chain import ChainPolicy

    backend = MemoryBackend(4, 64)
    policy = ChainPolicy(4)
    manager = TierStackManager(backend, policy, [MemoryTier("nvme", backend.rows, 8)], CascadeConfig())
    registry = prometheus_client.CollectorRegistry()
    registry.register(StatsCollector(manager.stats))
    assert manager.stats()["policy_protected_share"] == policy.protected_share == 0.0
    assert registry.get_sample_value("kvtier_policy_protected_share", {"tier": "cpu"}) == 0.0
    policy._set_share(0.9)  # what the tuner does when the 0.9 copy leads
    assert registry.get_sample_value("kvtier_policy_protected_share", {"tier": "cpu"}) == 0.9
    assert manager.stats()["policy_share_changes"] == 0
    arc = TierStackManager(MemoryBackend(4, 64), ARCPolicy(4), [], CascadeConfig())
    assert arc.stats()["policy_target_t1_blocks"] == 0.0
    assert "policy_protected_share" not in stack().stats()  # LRU learns nothing

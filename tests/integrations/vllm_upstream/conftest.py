"""Fixtures of the port of vLLM's own kv_offload tests: kvtier's classes where vLLM's tests
build vLLM's (see README.md beside this file for what is ported and what differs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# vllm_support lives one directory up; tests import it as a plain module.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("vllm.v1.kv_offload.base")


@pytest.fixture
def make_cpu_manager():
    """Builds kvtier's manager over a CPU tier of ``num_blocks`` rows where vLLM's tests build
    ``CPUOffloadingManager(num_blocks, cache_policy, enable_events)``: through vLLM's own
    spec factory, from kv_connector_extra_config, as an engine would. Shut down afterwards."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm_support import kvtier_extra, offloading_config

    made = []

    def make(num_blocks: int = 4, cache_policy: str = "lru", enable_events: bool = False):
        probe = offloading_config(kvtier_extra([{"kind": "cpu", "capacity": "1MiB"}]))
        row = OffloadingSpecFactory.create_spec(probe).layout.block_bytes
        tier = {
            "kind": "cpu",
            "capacity": num_blocks * row,
            "eviction": cache_policy,
            "pin_memory": "off",
        }
        config = offloading_config(kvtier_extra([tier]), events=enable_events)
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
        made.append(manager)
        assert manager.inner.backend.get_num_free_blocks() == num_blocks
        return manager

    yield make
    for manager in made:
        manager.shutdown()

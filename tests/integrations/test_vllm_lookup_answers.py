"""kvtier's two kinds of "not yet" reach vLLM as its two deferred answers: a promotion in
flight is HIT_PENDING, a block no tier can answer for yet (a remote tier asking its server)
is RETRY; either way the request is deferred and nothing unready is loaded."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm_support import STEP_END, key

from kvtier.config import CascadeConfig
from kvtier.integrations.vllm import KvtierOffloadingManager
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.tiers.base import TierJob
from kvtier.testing import MemoryBackend, MemoryTier

ROW = 64


class AskingTier(MemoryTier):
    """A MemoryTier that, like a remote tier, cannot tell at once whether it holds a key: a
    key is "unknown" (None) until the end of the step after it was first asked about."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: set[bytes] = set()
        self.answered: set[bytes] = set()

    def lookup(self, key: bytes) -> bool | None:
        if key in self.answered:
            return super().lookup(key)
        self.asked.add(key)
        return None

    def on_schedule_end(self) -> None:
        self.answered |= self.asked
        self.asked.clear()
        super().on_schedule_end()


def test_unknown_is_retry_then_a_promotion_is_hit_pending_then_hit():
    backend = MemoryBackend(16, ROW)
    tier = AskingTier("remote", backend.rows, 64)
    # The remote tier already holds key(1) (another engine stored it): put it there directly.
    backend.rows[0] = 7
    tier.submit_store(TierJob(1, (key(1),), (0,)))
    tier.get_finished_jobs()
    backend.rows[0] = 0
    inner = TierStackManager(backend, LRUPolicy(16), [tier], CascadeConfig(write_policy="write_back"))
    manager = KvtierOffloadingManager(inner, events=False, config_info={}, stats_log_interval_s=1e9)
    ctx = ReqContext("r")
    assert manager.lookup(key(1), ctx) is LookupResult.RETRY  # the server has not answered yet
    assert manager.lookup(key(2), ctx) is LookupResult.RETRY
    assert not inner.is_promoting(key(1))
    manager.on_schedule_end(STEP_END)  # the "server" answers: key(1) there, key(2) not
    assert manager.lookup(key(2), ctx) is LookupResult.MISS
    assert manager.lookup(key(1), ctx) is LookupResult.HIT_PENDING  # found below: read queued
    assert inner.is_promoting(key(1))
    for _ in range(3):
        manager.on_schedule_end(STEP_END)  # the read is submitted, runs, lands
        if manager.lookup(key(1), ctx) is LookupResult.HIT:
            break
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    row = inner.policy.get(key(1))
    assert np.all(backend.rows[row] == 7)  # the bytes the remote tier held, verified on arrival
    manager.shutdown()

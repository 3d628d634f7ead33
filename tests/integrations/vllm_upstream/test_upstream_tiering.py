"""vLLM's tiering manager tests (``TieringOffloadingManager`` over a CPU primary and two
in-memory secondary tiers), ported to run against kvtier's full stack.

The subject is ``KvtierOffloadingManager`` over ``TierStackManager`` with a CPU tier of five
rows and two ``MemoryTier`` lower tiers, the in-memory tiers standing where vLLM's tests put
``ExampleSecondaryTierManager``; ``write_through``, so every stored block is sent to both, as
vLLM's tiering does. vLLM reaches into its manager's job table and its tiers' ref counts;
kvtier's equivalents are its statistics, which the ports read. What differs on purpose is
in README.md beside this file.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)

from kvtier.config import CascadeConfig
from kvtier.integrations.vllm import KvtierOffloadingManager
from kvtier.manager.single import SingleTierManager
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.tiers.base import TierJob
from kvtier.testing import MemoryBackend, MemoryTier

CTX = ReqContext(req_id="test")
BLOCK = 256
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def to_keys(ints) -> list[OffloadKey]:
    return [make_offload_key(str(i).encode(), 0) for i in ints]


def count_hits(lookup, keys) -> int | None:
    """Leading HITs of ``keys``; None if any answer is pending (vLLM's helper)."""
    count = 0
    for key in keys:
        result = lookup(key, CTX)
        if result in (LookupResult.HIT_PENDING, LookupResult.RETRY):
            return None
        if result is not LookupResult.HIT:
            break
        count += 1
    return count


def block_bytes(key: OffloadKey) -> np.ndarray:
    return np.frombuffer((key * (BLOCK // len(key) + 1))[:BLOCK], dtype=np.uint8)


class Stack:
    """kvtier's stack where vLLM's ``manager_setup`` fixture builds its tiering manager."""

    def __init__(self, num_blocks: int = 5, lower: int = 2):
        self.backend = MemoryBackend(num_blocks, BLOCK)
        self.tiers = [MemoryTier(f"tier{i + 1}", self.backend.rows, 64) for i in range(lower)]
        inner = (
            TierStackManager(
                self.backend,
                LRUPolicy(num_blocks),
                self.tiers,
                CascadeConfig(write_policy="write_through"),
            )
            if lower
            else SingleTierManager(self.backend, LRUPolicy(num_blocks))
        )
        self.inner = inner
        self.manager = KvtierOffloadingManager(inner, events=True, config_info={}, stats_log_interval_s=0)
        self._seed_ids = iter(range(1 << 20, 1 << 21))

    def step(self) -> None:
        """vLLM's _simulate_on_schedule_end: the step ends, its events are drained."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        list(self.manager.take_events())

    def store(self, keys, ctx=CTX, success=True):
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.backend.rows[row] = block_bytes(key)
        self.manager.complete_store(keys, ctx, success=success)
        return out

    def seed(self, tier: MemoryTier, keys) -> None:
        """Put ``keys`` in a lower tier only, as vLLM's tests set ``tier.blocks[key] = True``."""
        rows = self.backend.rows
        scratch = rows[: len(keys)].copy()
        for row, key in enumerate(keys):
            rows[row] = block_bytes(key)
        job = TierJob(next(self._seed_ids), tuple(keys), tuple(range(len(keys))))
        tier.submit_store(job)
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()  # handed to nobody: the manager never saw it
        assert set(result.ok) == set(keys)
        rows[: len(keys)] = scratch
        list(tier.take_events())

    def figure(self, name: str):
        return self.inner.stats()[name]


@pytest.fixture
def stack():
    made = Stack()
    yield made
    made.manager.shutdown()


def test_basic_store_to_primary(stack):
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    out = stack.store(blocks)
    assert len(out.keys_to_store) == 3
    assert count_hits(stack.manager.lookup, blocks) == 3


def test_cascade_to_all_secondary_tiers(stack):
    """vLLM submits the cascade inside complete_store; kvtier at the end of the step
    (README: cascade at step end). Then every lower tier holds every block."""
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    stack.store(blocks)
    assert stack.figure("tier1.demote_jobs") == stack.figure("tier2.demote_jobs") == 0
    stack.step()  # the cascade is submitted, one job per tier
    assert stack.figure("tier1.demote_jobs") == stack.figure("tier2.demote_jobs") == 1
    stack.step()  # and polled
    for tier in stack.tiers:
        assert tier.num_blocks() == 3
        assert all(tier.lookup(k) is True for k in blocks)


def test_blocks_are_protected_during_cascade(stack):
    """vLLM: ref_cnt 2 (one per tier) until the cascade completes, then 0. kvtier: the block is
    held (not evictable) until every tier saved it, then evictable."""
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    stack.store(blocks)
    assert stack.figure("held_blocks") == 3 and stack.figure("dirty_blocks") == 3
    stack.step()  # submitted, not yet polled
    assert stack.figure("held_blocks") == 3
    stack.step()
    assert stack.figure("held_blocks") == 0 and stack.figure("dirty_blocks") == 0


def test_lookup_from_primary(stack):
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    stack.store(blocks)
    assert count_hits(stack.manager.lookup, blocks) == 3


def test_promotion_from_secondary(stack):
    blocks = to_keys(range(3))
    stack.seed(stack.tiers[0], blocks)
    for block in blocks:
        assert stack.manager.lookup(block, CTX) is PENDING  # promotion initiated
    stack.step()  # the reads are submitted
    stack.step()  # and polled
    assert count_hits(lambda k, c: HIT if stack.inner.policy.contains(k) else MISS, blocks) == 3
    assert count_hits(stack.manager.lookup, blocks) == 3
    spec = stack.manager.prepare_load(blocks, CTX)
    for key, row in zip(blocks, spec.chunk_ids):
        np.testing.assert_array_equal(stack.backend.rows[row], block_bytes(key))
    stack.manager.complete_load(blocks, CTX)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("corrupt-middle", [HIT, MISS, HIT]), ("fail-job", [MISS, MISS, MISS])],
    ids=["partial", "full-failure"],
)
def test_failed_promotion_keeps_only_successful_blocks(stack, fault, expected):
    """vLLM's tier reports which keys of a failed job loaded; kvtier's tier verifies every
    block and reports each failed one (here: one corrupt block, or the whole job failed)."""
    blocks = to_keys(range(3))
    tier = stack.tiers[0]
    stack.seed(tier, blocks)
    if fault == "fail-job":
        tier.fail_next(1, "EIO")
    else:
        tier.corrupt(blocks[1])
    for block in blocks:
        assert stack.manager.lookup(block, CTX) is PENDING
    stack.step()
    stack.step()
    in_primary = [HIT if stack.inner.policy.contains(k) else MISS for k in blocks]
    assert in_primary == expected


def test_partial_lookup(stack):
    blocks = to_keys(range(5))
    stack.manager.on_new_request(CTX)
    stack.store(blocks[:3])
    assert count_hits(stack.manager.lookup, blocks) == 3


def test_eviction_in_primary_tier(stack):
    blocks = to_keys(range(5))
    stack.manager.on_new_request(CTX)
    out = stack.store(blocks)
    assert len(out.keys_to_store) == 5
    # vLLM releases the cascade's ref counts at the next step; kvtier's cascade is submitted
    # at the end of this step and polled at the next (README: cascade at step end)
    stack.step()
    stack.step()
    out = stack.manager.prepare_store(to_keys(range(5, 7)), CTX)
    assert out is not None
    assert len(out.evicted_keys) == 2 and len(out.keys_to_store) == 2


def test_touch_refreshes_the_primary_tier(stack):
    """vLLM forwards touch() to every secondary tier; kvtier's lower tiers keep the recency of
    their own reads and writes (README: touch), so only the CPU tier's order is checked:
    the touched blocks are now the last to go."""
    blocks = to_keys(range(5))
    stack.manager.on_new_request(CTX)
    stack.store(blocks)
    stack.step()
    stack.step()  # saved below: every block evictable
    stack.manager.touch(blocks[:3], CTX)
    out = stack.manager.prepare_store(to_keys([10, 11]), CTX)
    assert out is not None and set(out.evicted_keys) == set(blocks[3:])


def test_failed_store_no_cascade(stack):
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    stack.store(blocks, success=False)
    stack.step()
    stack.step()
    assert stack.figure("tier1.demote_jobs") == stack.figure("tier2.demote_jobs") == 0
    assert all(tier.num_blocks() == 0 for tier in stack.tiers)


def test_lookups_of_two_requests_share_one_read_per_tier(stack):
    """vLLM submits one read job per request; kvtier one per tier per step, whoever asked
    (README: one read job per step). Either way nothing is read before the step ends."""
    blocks = to_keys(range(4))
    stack.seed(stack.tiers[0], blocks)
    ctx_a, ctx_b = ReqContext(req_id="req_a"), ReqContext(req_id="req_b")
    assert stack.manager.lookup(blocks[0], ctx_a) is PENDING
    assert stack.manager.lookup(blocks[1], ctx_a) is PENDING
    assert stack.manager.lookup(blocks[2], ctx_b) is PENDING
    assert stack.manager.lookup(blocks[3], ctx_b) is PENDING
    assert stack.figure("tier1.promote_jobs") == 0  # not during lookup
    stack.step()
    assert stack.figure("tier1.promote_jobs") == 1
    assert stack.figure("promoting_blocks") == 4


def test_lookup_shared_block_no_duplicate_promotion(stack):
    shared = to_keys([0])[0]
    stack.seed(stack.tiers[0], [shared])
    ctx_a, ctx_b = ReqContext(req_id="req_a"), ReqContext(req_id="req_b")
    assert stack.manager.lookup(shared, ctx_a) is PENDING
    assert stack.manager.lookup(shared, ctx_b) is PENDING
    stack.step()
    assert stack.figure("tier1.promote_jobs") == 1
    stack.step()
    assert stack.figure("tier1.promotions") == 1


def test_reset_cache_drains_all_tiers(stack):
    """reset_cache waits for the lower tiers' jobs before forgetting the CPU rows they read."""
    blocks = to_keys(range(3))
    stack.manager.on_new_request(CTX)
    stack.store(blocks)
    stack.step()  # the cascade is in flight
    assert stack.manager.has_pending_work()
    stack.manager.reset_cache()
    assert not stack.manager.has_pending_work()
    for block in blocks:
        assert not stack.inner.policy.contains(block)
    assert all(tier.num_blocks() == 3 for tier in stack.tiers)  # the tiers keep what they got
    stack.manager.on_reset_flushed()


@pytest.mark.parametrize(
    "load_tier_filter",
    [TierFilter(matchers=(TierMatcher(medium=Medium.CPU),)), TierFilter(matchers=())],
    ids=["non_matching_medium", "empty_no_load"],
)
def test_tier_filter_skips_filtered_secondary(stack, load_tier_filter):
    """vLLM's test tiers are CPU media, so its non-matching filter names STORAGE; kvtier's
    lower tiers are STORAGE, so the non-matching filter here names CPU."""
    blocks = to_keys(range(2))
    stack.manager.on_new_request(CTX)
    stack.store(blocks[:1])
    stack.seed(stack.tiers[0], blocks[1:])
    ctx = ReqContext(req_id="r1", load_tier_filter=load_tier_filter)
    assert stack.manager.lookup(blocks[0], ctx) is HIT
    assert stack.manager.lookup(blocks[1], ctx) is MISS
    stack.step()
    assert stack.figure("tier1.promote_jobs") == 0  # never asked, never read


@pytest.mark.parametrize(
    "load_tier_filter",
    [
        TierFilter.ALL,
        TierFilter(matchers=(TierMatcher(medium=Medium.STORAGE),)),
        TierFilter(matchers=(TierMatcher(),)),
    ],
    ids=["all", "explicit_storage", "unconstrained_matcher"],
)
def test_tier_filter_allows_matching_secondary(stack, load_tier_filter):
    blocks = to_keys(range(1))
    stack.seed(stack.tiers[0], blocks)
    ctx = ReqContext(req_id="r2", load_tier_filter=load_tier_filter)
    assert stack.manager.lookup(blocks[0], ctx) is PENDING


def test_works_without_secondary_tiers():
    made = Stack(lower=0)
    try:
        blocks = to_keys(range(3))
        made.manager.on_new_request(CTX)
        made.store(blocks)
        assert count_hits(made.manager.lookup, blocks) == 3
    finally:
        made.manager.shutdown()

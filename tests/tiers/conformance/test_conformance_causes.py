"""Each miss cause made by a real fault of every lower-tier kind, counted exactly once.

The same harnesses as ``test_conformance.py`` (lmdb and files on real filesystems, a real
Valkey server and cluster, the in-memory double, the out-of-tree example): a block removed,
damaged or rewritten under another layout behind the tier's back, a medium gone down, hung or
full, a request filtered off the tier. Each key is looked up on its own until it settles, so
each miss is counted once, and the scenario decides its cause and its count exactly.
"""

from __future__ import annotations

import pytest
from kvtier_testing.conformance.conformance_stack import FAR, Stack, build, keys

from kvtier.base import LoadTiers, ReqContext
from kvtier.manager.causes import CAUSES


def settle_each(stack: Stack, blocks, ctx: ReqContext | None = None) -> list[bool]:
    """Each key's answer, looked up alone (stepping while None), so each miss counts once."""
    answers = []
    for k in blocks:
        if ctx is None:
            answers.append(stack.resolve([k])[k])
            continue
        for _ in range(400):
            answer = stack.manager.lookup(k, ctx)
            if answer is not None:
                break
            stack.step()
        answers.append(answer)
    return answers


def causes_of(stats: dict) -> dict[str, int]:
    """The non-zero miss causes, which sum to the misses."""
    counted = {cause: stats[f"miss_{cause}"] for cause in CAUSES if stats[f"miss_{cause}"]}
    assert sum(counted.values()) == stats["misses"]
    return counted


DAMAGE = {
    # scenario: (harness method, the cause, the foreign part)
    "missing": ("remove", "evicted", None),
    "corrupt": ("corrupt", "corrupt", None),
    "short": ("truncate", "corrupt", None),
    "other layout": ("relayout", "foreign", "layout"),
}


@pytest.mark.parametrize("scenario", list(DAMAGE))
def test_a_damaged_block_misses_under_its_cause(harness, stacks, scenario):
    damage, cause, part = DAMAGE[scenario]
    if scenario == "other layout" and harness.checks.get(scenario) != "corrupt_other_layout":
        # a kind whose check cannot tell another layout from damage (one digest over layout,
        # key and payload: the out-of-tree example) reports it corrupt, and so is the miss
        cause, part = "corrupt", None
    stack = build(harness, stacks, scenario)
    blocks = keys(0, 8)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    victim = harness.victim(stack.tier, blocks)
    getattr(harness, damage)(stack.tier, [victim])
    stack.forget()
    before = stack.stats()["misses"]

    assert settle_each(stack, [victim]) == [False]
    stats = stack.stats()
    assert stats["misses"] - before == 1
    assert causes_of(stats) == {cause: 1}
    assert stats[f"{FAR}.miss_{cause}"] == 1  # the far tier's fault
    if part is not None:
        assert stats[f"foreign_{part}"] == 1
    served, wrong = stack.serve([k for k in blocks if k != victim])  # the rest still served
    assert wrong == 0 and len(served) == len(blocks) - 1


def test_blocks_never_stored_are_new(harness, stacks):
    stack = build(harness, stacks, "round trip")
    fresh = keys(500, 6)
    assert settle_each(stack, fresh) == [False] * 6
    stats = stack.stats()
    assert causes_of(stats) == {"new": 6}
    assert stats[f"{FAR}.miss_evicted"] == 0


def test_a_medium_gone_down_makes_unavailable_misses(harness, stacks):
    stack = build(harness, stacks, "down")
    before = keys(0, 6)
    stack.store(before)
    assert stack.saved(before) == before
    harness.go_down(stack.tier)
    stack.forget()

    assert settle_each(stack, before) == [False] * 6
    stats = stack.stats()
    assert causes_of(stats) == {"unavailable": 6}
    assert stats[f"{FAR}.miss_unavailable"] == 6


def test_a_hung_medium_makes_unavailable_misses(harness, stacks):
    stack = build(harness, stacks, "timeout")
    before = keys(0, 4)
    stack.store(before)
    assert stack.saved(before) == before
    stack.forget()
    harness.hang(stack.tier)
    try:
        assert settle_each(stack, before) == [False] * 4
    finally:
        harness.unhang(stack.tier)
    stats = stack.stats()
    assert causes_of(stats) == {"unavailable": 4}
    assert stats[f"{FAR}.miss_unavailable"] == 4


def test_blocks_a_full_medium_refused_are_store_failed(harness, stacks):
    stack = build(harness, stacks, "full", cpu_blocks=64)
    harness.fill(stack.tier)
    try:
        during = keys(100, 48)
        stack.store(during)
        failed = [k for k in during if k not in stack.saved(during)]
        assert failed
    finally:
        harness.unfill(stack.tier)
    stack.forget()
    assert settle_each(stack, failed) == [False] * len(failed)
    stats = stack.stats()
    assert causes_of(stats) == {"store_failed": len(failed)}
    assert stats[f"{FAR}.miss_store_failed"] == len(failed)


def test_a_request_filtered_off_the_tier_misses_as_filtered(harness, stacks):
    stack = build(harness, stacks, "round trip")
    blocks = keys(0, 6)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    stack.forget()
    limited = ReqContext("no lower tiers")
    limited.set_state(LoadTiers(frozenset()))

    assert settle_each(stack, blocks, limited) == [False] * 6
    stats = stack.stats()
    assert causes_of(stats) == {"filtered": 6}
    assert stats[f"{FAR}.miss_filtered"] == 6

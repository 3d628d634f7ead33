"""One set of scenarios for every lower-tier kind, through ``TierStackManager``.

Each scenario runs once per harness (``tier_harness.cases()``: every kind registered in
``TIER_KINDS`` below the CPU tier, the in-memory double and the out-of-tree example) and
checks three things: every block served is compared byte for byte with what was stored; the
counters (the manager's ``far.promotions`` / ``promote_failures`` / ``corrupt_blocks`` /
``demotions`` / ``demote_failures``, and the tier's own where the harness names them); and
that no scheduler-side call raised (every call goes through ``conformance_stack.Stack``).
A scenario a kind cannot express is skipped by its harness, naming the kind and why.
"""

from __future__ import annotations

import pytest
from kvtier_testing.conformance.conformance_stack import Stack, build, keys


def assert_round_trip(stack: Stack, blocks) -> None:
    """``blocks`` are saved below, then served from there byte for byte."""
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    stack.forget()
    served, wrong = stack.serve(blocks)
    assert served == blocks and wrong == 0


def test_round_trip(harness, stacks):
    stack = build(harness, stacks, "round trip")
    blocks = keys(0, 16)
    assert_round_trip(stack, blocks)
    stats = stack.stats()
    assert stats["far.demotions"] == len(blocks) and stats["far.demote_failures"] == 0
    assert stats["far.promotions"] == len(blocks) and stats["far.promote_failures"] == 0
    assert stats["far.corrupt_blocks"] == 0
    names = harness.counters
    assert stack.far(names["stored"]) in (len(blocks), None)  # None: the kind does not count it
    assert stack.far(names["loaded"]) in (len(blocks), None)
    assert stack.far(names["corrupt"]) in (0, None)
    assert stack.far(names["missing"]) in (0, None)
    assert stack.far(names["failed"]) in (0, None)


DAMAGE = {
    # scenario: (harness method, a verification failure, not a missing block)
    "missing": ("remove", False),
    "corrupt": ("corrupt", True),
    "short": ("truncate", True),
    "other layout": ("relayout", True),
}


@pytest.mark.parametrize("scenario", list(DAMAGE))
def test_a_damaged_block_is_a_counted_miss_never_served(harness, stacks, scenario):
    damage, corrupt = DAMAGE[scenario]
    stack = build(harness, stacks, scenario)
    blocks = keys(0, 8)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    victim = harness.victim(stack.tier, blocks)
    getattr(harness, damage)(stack.tier, [victim])

    stack.forget()
    served, wrong = stack.serve(blocks)
    assert wrong == 0
    assert served == [k for k in blocks if k != victim]
    stats = stack.stats()
    assert stats["far.promotions"] == len(blocks) - 1
    assert stats["far.promote_failures"] == 1
    assert stats["far.corrupt_blocks"] == int(corrupt)
    names = harness.counters
    assert stack.far(names["corrupt"]) in (int(corrupt), None)
    assert stack.far(names["missing"]) in (int(not corrupt), None)
    assert stack.far(names["failed"]) in (1, None)
    if scenario in harness.checks:  # which check caught it
        assert stack.far(harness.checks[scenario]) == 1
    # dropped from the tier: asked again, a plain miss
    stack.step()
    assert stack.resolve([victim]) == {victim: False}
    assert stack.stats()["far.promote_failures"] == 1


def test_a_hung_medium_times_out_and_the_tier_recovers(harness, stacks):
    stack = build(harness, stacks, "timeout")
    before, during, after = keys(0, 8), keys(100, 8), keys(200, 8)
    stack.store(before)
    assert stack.saved(before) == before
    stack.forget()
    harness.hang(stack.tier)
    try:
        served, wrong = stack.serve(before)  # the reads time out: misses, never bytes
        assert served == [] and wrong == 0
        assert stack.stats()["far.promote_failures"] == len(before)
        stack.store(during)  # so do the saves; the CPU tier keeps the blocks
        assert stack.stats()["far.demote_failures"] == len(during)
        served, wrong = stack.serve(during)  # (forgot nothing: these are CPU hits)
        assert served == during and wrong == 0
    finally:
        harness.unhang(stack.tier)
    wait_recovered(harness, stack)
    assert_round_trip(stack, after)


def wait_recovered(harness, stack) -> None:
    for _ in range(4000):
        if harness.recovered(stack.tier):
            return
        stack.step(drain=False)
    raise AssertionError(f"{harness.label}: the tier never served again")


def test_a_medium_gone_down_fails_saves_and_reads_as_counted_misses(harness, stacks):
    stack = build(harness, stacks, "down")
    before, during, after = keys(0, 8), keys(100, 8), keys(200, 8)
    stack.store(before)
    assert stack.saved(before) == before
    harness.go_down(stack.tier)

    stack.store(during)
    assert stack.saved(during) == []
    stats = stack.stats()
    assert stats["far.demote_failures"] == len(during) and stats["far.demotions"] == len(before)
    served, wrong = stack.serve(during)  # refused below, still served by the CPU tier
    assert served == during and wrong == 0

    stack.forget()
    misses = stack.stats()["misses"]
    served, wrong = stack.serve(before)  # nothing comes back from a dead medium
    assert served == [] and wrong == 0
    stats = stack.stats()
    assert stats["far.promotions"] == 0 and stats["far.corrupt_blocks"] == 0
    if harness.reads_when_down == "fail":  # sent, failed, counted
        assert stats["far.promote_failures"] == len(before)
    else:  # never sent: plain misses
        assert stats["far.promote_failures"] == 0 and stats["misses"] - misses == len(before)
    name = harness.counters["down"]
    assert name is None or stack.far(name) >= 1

    if not harness.come_back(stack.tier):
        return
    wait_recovered(harness, stack)
    assert_round_trip(stack, after)


def test_a_full_medium_refuses_saves_and_keeps_serving(harness, stacks):
    stack = build(harness, stacks, "full", cpu_blocks=64)  # every block of the scenario fits
    before, during, after = keys(0, 8), keys(100, 48), keys(200, 8)
    stack.store(before)
    assert stack.saved(before) == before
    harness.fill(stack.tier)
    try:
        stack.store(during)
        failed = [k for k in during if k not in stack.saved(during)]
        assert failed  # the medium refused some (lmdb: only once its index must grow)
        stats = stack.stats()
        assert stats["far.demote_failures"] == len(failed)
        assert stack.far(harness.counters["full"]) in (len(failed), None)
        served, wrong = stack.serve(during)  # refused below, still served by the CPU tier
        assert served == during and wrong == 0
        stack.forget()
        served, wrong = stack.serve(before)  # what the full medium holds is still served
        assert served == before and wrong == 0
    finally:
        harness.unfill(stack.tier)
    stack.store(after)  # room again
    assert stack.saved(after) == after
    assert stack.stats()["far.promote_failures"] == 0


def test_a_slow_read_answers_none_until_it_lands(harness, stacks):
    stack = build(harness, stacks, "slow")
    blocks = keys(0, 8)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    stack.forget()
    harness.hold_reads(stack.tier)
    try:
        for _ in range(5):  # steps go on while the reads are held: the engine waits, unblocked
            assert set(stack.answers(blocks).values()) == {None}
            stack.step(drain=False)
        assert stack.manager.has_pending_work()
    finally:
        harness.release_reads(stack.tier)
    served, wrong = stack.serve(blocks, drain=False)
    assert served == blocks and wrong == 0
    stats = stack.stats()
    assert stats["far.promotions"] == len(blocks) and stats["far.promote_failures"] == 0


def test_a_restarted_tier_serves_what_it_stored(harness, stacks):
    stack = build(harness, stacks, "restart")
    if not harness.persistent:
        harness.cannot("restart", "a reopened tier starts empty")
    blocks = keys(0, 16)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    again = stack.reopen()
    stacks.append(again)
    served, wrong = again.serve(blocks)
    assert served == blocks and wrong == 0
    stats = again.stats()
    assert stats["far.promotions"] == len(blocks) and stats["far.promote_failures"] == 0

"""Conformance harness of the in-memory lower tier (``kvtier.testing.memory.MemoryTier``).

``MemoryTier`` is a test double with no kind in ``TIER_KINDS``; :class:`MemoryTierConfig` here
gives it a section (named by class path, as any out-of-tree kind is), so that the same
scenarios build it through ``build_manager`` and ``kvtier replay``. Its faults are the ones it
was made to inject: ``fail_next`` (EIO, ENOSPC), ``paused`` (jobs held in flight), and its
dict of blocks, damaged directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier_testing.conformance.tier_harness import Harness, register

from kvtier.config import TierConfig
from kvtier.testing import MemoryTier

#: jobs that fail while the "medium is down" (more than any scenario submits)
_DOWN_JOBS = 1 << 20


@dataclass(frozen=True)
class MemoryTierConfig(TierConfig):
    """A :class:`MemoryTier` of ``capacity`` (no keys of its own)."""

    def open_lower(self, rows, fingerprint, *, field, **options):
        return MemoryTier(self.name, rows, self.capacity_bytes // rows.shape[1])


@register
class MemoryHarness(Harness):
    kind = "kvtier_testing.conformance.harness_memory:MemoryTierConfig"
    label = "memory"
    counters: ClassVar[dict[str, str | None]] = {
        "stored": "stored",
        "loaded": "loaded",
        "missing": "missing",
        "corrupt": "corrupt",
        "failed": "failed_keys",
        "full": "failed_ENOSPC",
        "down": "failed_EIO",
    }
    persistent = False

    def place(self, scenario):
        super().place(scenario)
        if scenario == "replay down":
            self.cannot(
                "a dead medium under replay",
                "its failures are injected into a tier object the replay builds for itself",
            )
        if scenario == "restart":
            self.cannot("restart", "its blocks live in the tier object, and a reopened tier starts empty")

    def section(self, blocks, block_bytes):
        return {"kind": self.kind, "capacity": blocks * block_bytes}

    def remove(self, tier, keys):
        for k in keys:
            del tier._blocks[k]

    def corrupt(self, tier, keys):
        for k in keys:
            tier.corrupt(k)

    def truncate(self, tier, keys):
        for k in keys:
            payload, checksum = tier._blocks[k]
            tier._blocks[k] = (payload[:100], checksum)

    def relayout(self, tier, keys):
        self.cannot("another layout", "its blocks carry no layout (one process, one layout)")

    def listed(self, tier):
        self.cannot("damage between runs", "its blocks live in the tier object, gone when it closes")

    def go_down(self, tier):
        tier.fail_next(_DOWN_JOBS, "EIO")

    def come_back(self, tier):
        tier._fail_next.clear()
        return True

    def hang(self, tier):
        self.cannot("timeout", "its jobs run when polled: nothing waits, nothing times out")

    def fill(self, tier):
        tier.fail_next(1, "ENOSPC")  # the scenario's next job: the one that meets the full medium

    def unfill(self, tier):
        tier._fail_next.clear()

    def hold_reads(self, tier):
        tier.paused = True

    def release_reads(self, tier):
        tier.paused = False

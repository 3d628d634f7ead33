"""The conformance harness of the out-of-tree example kind (``remote_tier.py`` beside it).

A kind written outside kvtier brings its harness the same way: a module like this one, with a
``tier_harness.Harness`` subclass decorated with ``tier_harness.register``, named in the
environment variable ``KVTIER_CONFORMANCE_HARNESSES`` when kvtier's suite runs
(``KVTIER_CONFORMANCE_HARNESSES=my_pkg.kvtier_harness pytest tests/tiers/conformance``). This
one is listed in ``tier_harness.HARNESS_MODULES`` because the example ships with the tests.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import ClassVar

import remote_tier
from kvtier_testing.conformance.tier_harness import Harness, register


@register
class RemoteTierHarness(Harness):
    kind = "remote_tier:RemoteTierConfig"
    label = "remote_tier"
    counters: ClassVar[dict[str, str | None]] = {
        "stored": "stored",
        "loaded": "loaded",
        "missing": "missing",
        "corrupt": "corrupt",
        "failed": "failed_keys",
        "full": None,
        "down": None,
    }

    checks: ClassVar[dict[str, str]] = {
        "corrupt": "corrupt_digest",
        "short": "corrupt_truncated",
        "other layout": "corrupt_digest",
    }

    def __init__(self, request, tmp_path):
        super().__init__(request, tmp_path)
        self.url = "mem://conformance-" + uuid.uuid4().hex[:12]
        self.exits.callback(remote_tier.BUCKETS.pop, self.url, None)

    def place(self, scenario):
        super().place(scenario)
        if scenario == "replay down":
            self.cannot("down", "its service is a dict in this process, which cannot go away")

    def section(self, blocks, block_bytes):
        return {"kind": self.kind, "url": self.url, "capacity": blocks * block_bytes}

    def _bucket(self):
        return remote_tier.BUCKETS[self.url]

    def remove(self, tier, keys):
        for k in keys:
            del self._bucket()[k]

    def corrupt(self, tier, keys):
        bucket = self._bucket()
        for k in keys:
            payload, digest = bucket[k]
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0x5A
            bucket[k] = (bytes(damaged), digest)

    def truncate(self, tier, keys):
        bucket = self._bucket()
        for k in keys:
            payload, digest = bucket[k]
            bucket[k] = (payload[:100], digest)

    def relayout(self, tier, keys):
        bucket = self._bucket()
        other = hashlib.blake2b(b"another-model", digest_size=16).digest()
        for k in keys:
            payload, _ = bucket[k]
            bucket[k] = (payload, hashlib.blake2b(other + k + payload, digest_size=16).digest())

    def listed(self, tier):
        return list(self._bucket())

    def go_down(self, tier):
        self.cannot("down", "its service is a dict in this process, which cannot go away")

    def hang(self, tier):
        self.cannot("timeout", "its service answers at once, in the caller's thread")

    def fill(self, tier):
        self.cannot("full", "its service has no limit of its own (the tier's capacity evicts)")

    def hold_reads(self, tier):
        self.cannot("slow read", "its jobs finish in the poll that collects them: nothing to hold")

"""A CPU tier above one harnessed lower tier, driven the way an engine's scheduler drives it.

Every manager call an engine makes goes through here (lookup, prepare/complete store and
load, on_schedule_end, reset_cache): an exception from any of them fails the scenario, so a
scenario that passes shows the scheduler never raised.
"""

from __future__ import annotations

import time

import numpy as np
from kvtier_testing import key, kv_payload, payload, read_blocks, store_blocks
from kvtier_testing.conformance.tier_harness import BLOCK, Harness

import kvtier
from kvtier.base import OffloadKey, ReqContext
from kvtier.tiers.cpu.region import row_stride_for
from kvtier.tiers.disk.format import LayoutFingerprint

CTX = ReqContext("conformance")
#: the lower tier's name in the stack: its stats are ``far.<name>``
FAR = "far"
#: how long a scenario steps before it gives up on an answer (never a timing assertion: a
#: tier that never settles fails the scenario; one that settles in time passes whatever the load)
SETTLE_S = 20.0


class Stack:
    """``build_manager`` over a 32-row CPU tier (write_through) and the harness's section.

    ``codec``: the lower tier stores blocks with it (:mod:`kvtier.codecs`); the blocks are then
    bf16 KV-like values of ``block_bytes`` (a lossy codec reads them as values), and a block
    served is compared with what the codec promises (its own decode, when lossy)."""

    def __init__(
        self,
        harness: Harness,
        cpu_blocks: int = 32,
        lower_blocks: int = 128,
        config: dict | None = None,
        codec: str = "none",
        block_bytes: int = BLOCK,
    ):
        self.harness = harness
        self.codec = codec
        self.block_bytes = block_bytes
        section = harness.section(lower_blocks, block_bytes)
        if codec != "none":
            section["codec"] = codec
        self.config = config or {
            "tiers": [
                {
                    "name": "cpu",
                    "kind": "cpu",
                    "capacity": cpu_blocks * row_stride_for(block_bytes),
                    "pin_memory": "off",
                },
                {"name": FAR, **section},
            ],
            "cascade": {"write_policy": "write_through"},
        }
        dtype = "uint8" if codec == "none" else "bfloat16"
        self.make = payload if codec == "none" else kv_payload
        fingerprint = LayoutFingerprint.standalone(block_bytes, dtype)
        self.manager = kvtier.build_manager(self.config, block_bytes, fingerprint=fingerprint)
        (self.tier,) = self.manager.tiers
        self._closed = False

    def reopen(self, codec: str | None = None) -> Stack:
        """Shut this stack down and build the same one again (a restart; ``codec``: with
        another codec)."""
        self.shutdown()
        config = self.config
        if codec is not None:
            config = {**config, "tiers": [config["tiers"][0], {**config["tiers"][1], "codec": codec}]}
        return Stack(self.harness, config=config, codec=codec or self.codec, block_bytes=self.block_bytes)

    def expected(self, k: OffloadKey) -> np.ndarray:
        """What a load of ``k`` must give: its bytes, or a lossy codec's decode of them."""
        block = self.make(k, self.block_bytes)
        codec = getattr(self.tier, "codec", None)
        return codec.decode(codec.encode(block)) if codec is not None and codec.lossy else block

    # -- what an engine does ---------------------------------------------------------------------

    def store(self, keys: list[OffloadKey], per_job: int = 8) -> None:
        """Store ``keys`` in the CPU tier (each block its own bytes) and wait for the lower
        tier's answer, ``per_job`` blocks per step (each step's saves are one job)."""
        for first in range(0, len(keys), per_job):
            store_blocks(self.manager, keys[first : first + per_job], CTX, make=self.make)
            self.manager.on_schedule_end()  # submits the step's saves
            self.manager.flush()  # waits for them

    def saved(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The keys the lower tier says it holds."""
        return [k for k in keys if self.tier.lookup(k) is True]

    def forget(self) -> None:
        """The CPU tier forgets everything: what is served next comes from below."""
        self.manager.reset_cache()

    def answers(self, keys: list[OffloadKey]) -> dict[OffloadKey, bool | None]:
        return {k: self.manager.lookup(k, CTX) for k in keys}

    def step(self, drain: bool = True) -> None:
        """End a scheduler step; with ``drain``, wait for the tier's jobs (so the next step
        polls them), else give its threads a moment."""
        self.manager.on_schedule_end()
        if drain:
            self.tier.drain_jobs()
        else:
            time.sleep(0.005)

    def resolve(self, keys: list[OffloadKey], drain: bool = True) -> dict[OffloadKey, bool]:
        """Look ``keys`` up as an engine does, stepping while any answer is None."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            # every key again each round: a step may evict what looked up True before it
            answers = self.answers(keys)
            if None not in answers.values():
                return answers
            assert time.monotonic() < deadline, f"lookups never settled: {answers}"
            self.step(drain)

    def read(self, keys: list[OffloadKey]) -> int:
        """Load ``keys`` (all looked up True) as the engine does; how many came back wrong."""
        if not keys:
            return 0
        got = read_blocks(self.manager, keys, CTX)
        return sum(not np.array_equal(g, self.expected(k)) for k, g in zip(keys, got, strict=True))

    def serve(self, keys: list[OffloadKey], drain: bool = True) -> tuple[list[OffloadKey], int]:
        """Look up and load ``keys``; ``(keys served, wrong blocks among them)``."""
        answers = self.resolve(keys, drain)
        served = [k for k in keys if answers[k]]
        return served, self.read(served)

    def stats(self) -> dict[str, int]:
        return self.manager.stats()

    def far(self, name: str | None) -> int | None:
        """The lower tier's counter ``name`` (None: the kind does not report it)."""
        if name is None:
            return None
        stats = self.stats()
        if name.startswith(("failed_", "corrupt_")):  # a per-reason counter appears once counted
            return stats.get(f"{FAR}.{name}", 0)
        return stats[f"{FAR}.{name}"]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.shutdown()


def keys(start: int, count: int) -> list:
    """The test keys ``start`` .. ``start + count - 1``."""
    return [key(i) for i in range(start, start + count)]


def build(harness, stacks: list[Stack], scenario: str, **sizes) -> Stack:
    """A stack over ``harness`` set up for ``scenario``, shut down by the ``stacks`` fixture."""
    harness.place(scenario)
    stack = Stack(harness, **sizes)
    stacks.append(stack)
    return stack

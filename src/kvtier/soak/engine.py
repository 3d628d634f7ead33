"""The soak's engine: requests in, every block served compared, counts kept.

A :class:`SoakEngine` drives one stack as an engine would: each request's blocks are looked up
(stepping while an answer is ``None``, as a read comes up from below), its cached prefix is
loaded and compared byte for byte with what its key must hold, the rest "computed" and
stored. It remembers the blocks one lower tier (``watched``) reported stored, from the
stack's events: the blocks the soak holds that tier to.
"""

from __future__ import annotations

from collections import Counter

import kvtier
from kvtier.base import OffloadKey, ReqContext
from kvtier.manager.stack import TierStackManager
from kvtier.mediums import BlockIDsLoadStoreSpec
from kvtier.soak.blocks import is_exact, payload
from kvtier.tiers.cpu.backend import CPUBackend
from kvtier.tiers.cpu.region import row_stride_for

__all__ = ["BLOCK_BYTES", "CPU_BLOCKS", "CTX", "FAMILIES", "FAMILY_BLOCKS", "SoakEngine", "soak_stack"]

BLOCK_BYTES = 16 * 1024
#: the CPU tier's blocks: far fewer than the requests touch, so blocks keep moving down and up
CPU_BLOCKS = 128
#: prefix families of the load, and the longest prefix
FAMILIES = 64
FAMILY_BLOCKS = 16
CTX = ReqContext("soak")


def soak_stack(below: dict, write_policy: str) -> dict:
    """The soak's stack configuration: its CPU tier over the tier section ``below``."""
    return {
        "tiers": [
            {
                "name": "cpu",
                "kind": "cpu",
                "capacity": CPU_BLOCKS * row_stride_for(BLOCK_BYTES),
                "pin_memory": "off",
            },
            below,
        ],
        "cascade": {"write_policy": write_policy},
    }


class SoakEngine:
    """The soak's side of one stack (``config``: a CPU tier first, then ``tiers``): requests
    in, bytes checked, counts kept in ``counts``; ``committed`` collects the keys the lower
    tier number ``watched`` reported stored and has not dropped, in order."""

    def __init__(self, config: dict, counts: Counter, committed: dict[OffloadKey, None], watched: int = 0):
        self.config = config
        manager = kvtier.build_manager(self.config, BLOCK_BYTES)
        assert isinstance(manager, TierStackManager) and isinstance(manager.backend, CPUBackend)
        self.manager = manager  # a stack over the cpu tier
        self.backend = manager.backend
        self.tier = self.manager.tiers[watched]
        self.counts = counts
        self.committed = committed

    def step(self) -> None:
        self.manager.on_schedule_end()
        self._events()

    def _events(self) -> None:
        medium = self.tier.medium
        for event in self.manager.take_events():
            if event.medium != medium:
                continue
            for key in event.keys:
                if event.removed:
                    self.committed.pop(key, None)
                else:
                    self.committed[key] = None

    def resolve(self, keys: list[OffloadKey]) -> list[bool]:
        """Look ``keys`` up as an engine does, stepping while any answer is None; the answers
        of the last round, all given in the current step (a step may evict what was True)."""
        for _ in range(200):
            answers = [self.manager.lookup(key, CTX) for key in keys]
            self.counts["lookups"] += len(keys)
            if None not in answers:
                return [bool(a) for a in answers]
            self.step()
            for tier in self.manager.tiers:
                tier.drain_jobs()
        raise RuntimeError("kvtier soak: lookups did not resolve in 200 steps")

    def serve(self, keys: list[OffloadKey]) -> None:
        """Load ``keys`` (all looked up True this step) and compare every block."""
        spec = self.manager.prepare_load(keys, CTX)
        assert isinstance(spec, BlockIDsLoadStoreSpec)  # the CPU tier's rows
        rows = self.backend.rows
        for key, row in zip(keys, spec.block_ids):
            self.counts["blocks_loaded"] += 1
            if not is_exact(rows[row], key):
                self.counts["wrong_blocks_served"] += 1
        self.manager.complete_load(keys, CTX)

    def request(self, keys: list[OffloadKey]) -> None:
        answers = self.resolve(keys)
        hit = 0
        while hit < len(keys) and answers[hit]:
            hit += 1
        if hit:
            self.serve(keys[:hit])
        rest = keys[hit:]
        if rest:
            out = self.manager.prepare_store(rest, CTX)
            if out is None:  # every CPU row held (being saved below): a miss, as in an engine
                self.counts["stores_refused"] += 1
            else:
                assert isinstance(out.store_spec, BlockIDsLoadStoreSpec)  # the CPU tier's rows
                rows = self.backend.rows
                for key, row in zip(out.keys_to_store, out.store_spec.block_ids):
                    rows[row] = payload(key, BLOCK_BYTES)
                self.manager.complete_store(rest, CTX)
                self.counts["blocks_stored"] += len(out.keys_to_store)
        self.counts["requests"] += 1
        self.step()

    def stats(self) -> dict[str, float]:
        return self.manager.stats()

    def shutdown(self) -> None:
        self.manager.flush()
        self._events()
        self.manager.shutdown()

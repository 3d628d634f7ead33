"""A real CPU + disk stack (``kvtier.build_manager``) driven the way an engine drives it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvtier_testing import payload, read_blocks, store_blocks

import kvtier
from kvtier.base import OffloadKey, ReqContext
from kvtier.tiers.cpu.region import row_stride_for
from kvtier.tiers.disk.format import on_disk_block_bytes

__all__ = ["BLOCK", "CTX", "Stack"]

#: not a multiple of 4096, so O_DIRECT moves each row's padded span
BLOCK = 12_000
CTX = ReqContext("fault-test")


class Stack:
    """A manager over a ``cpu`` tier and one disk tier named ``disk`` at ``path``.

    ``write_through``, so every stored block is offered to the disk at the next step, and
    :meth:`save` waits for the disk's answer.
    """

    def __init__(
        self, kind: str, path: Path, cpu_blocks: int = 64, disk_blocks: int = 128, fsync: str = "batch"
    ):
        self.config = {
            "tiers": [
                {
                    "name": "cpu",
                    "kind": "cpu",
                    "capacity": cpu_blocks * row_stride_for(BLOCK),
                    "pin_memory": "off",
                },
                {
                    "name": "disk",
                    "kind": kind,
                    "path": str(path),
                    "fsync": fsync,
                    "capacity": disk_blocks * on_disk_block_bytes(BLOCK),
                },
            ],
            "cascade": {"write_policy": "write_through"},
        }
        self.manager = kvtier.build_manager(self.config, BLOCK)
        self.disk = self.manager.tiers[0]

    def store(self, keys: list[OffloadKey]) -> None:
        """Store ``keys`` into the CPU tier (each block its own bytes) and save them below."""
        store_blocks(self.manager, keys, CTX)
        self.save()

    def save(self) -> None:
        """Step until every demotion has its answer from the disk (stored or refused)."""
        self.manager.on_schedule_end()  # submits this step's demotions
        self.manager.flush()  # waits for them, and saves whatever is still dirty

    def on_disk(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        return [k for k in keys if self.disk.lookup(k)]

    def cpu_hits(self, keys: list[OffloadKey]) -> int:
        """Read ``keys`` from the CPU tier (all must look up True there); wrong blocks seen."""
        assert all(self.manager.lookup(k, CTX) is True for k in keys)
        return wrong_blocks(keys, read_blocks(self.manager, keys, CTX))

    def disk_hits(self, keys: list[OffloadKey]) -> tuple[list[OffloadKey], int]:
        """Forget the CPU tier, then look ``keys`` up as an engine does (stepping while the
        answer is None) and read those found; ``(keys served, wrong blocks among them)``."""
        manager = self.manager
        manager.reset_cache()
        for _ in range(50):
            # every key again each round: a step may evict what looked up True before it
            answers = {k: manager.lookup(k, CTX) for k in keys}
            if None not in answers.values():
                break
            manager.on_schedule_end()
            for tier in manager.tiers:
                tier.drain_jobs()
        assert None not in answers.values(), "lookups never resolved"
        served = [k for k in keys if answers[k]]
        wrong = wrong_blocks(served, read_blocks(manager, served, CTX)) if served else 0
        return served, wrong

    def stats(self) -> dict[str, int]:
        return self.manager.stats()

    def shutdown(self) -> None:
        self.manager.shutdown()


def wrong_blocks(keys: list[OffloadKey], got: list[np.ndarray]) -> int:
    return sum(not np.array_equal(g, payload(k, BLOCK)) for k, g in zip(keys, got, strict=True))

"""The smallest working tier: rows in this process's memory. A test double and a template.

Copy this file to start a new tier: a Backend needs slots (a SlotAllocator), a spec type
for its medium and nothing else; the manager and the policy do the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtier.base import Backend, BlockStatus, OffloadKey
from kvtier.mediums import MemoryLoadStoreSpec
from kvtier.tiers.slots import SlotAllocator

__all__ = ["MemoryBackend", "NullBackend"]


class MemoryBackend(Backend):
    """``num_blocks`` rows of ``block_bytes`` in a private numpy array (not shared, not pinned)."""

    def __init__(self, num_blocks: int, block_bytes: int):
        super().__init__(block_bytes, MemoryLoadStoreSpec.medium())
        self.rows = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self._slots = SlotAllocator(num_blocks)

    def get_num_free_blocks(self) -> int:
        return self._slots.num_free()

    def allocate_block_ids(self, count: int) -> list[int]:
        return self._slots.allocate(count)

    def free_block_ids(self, block_ids: Iterable[int]) -> None:
        self._slots.free(block_ids)

    def get_load_store_spec(
        self, keys: Iterable[OffloadKey], blocks: Iterable[int] | Iterable[BlockStatus]
    ) -> MemoryLoadStoreSpec:
        return MemoryLoadStoreSpec(
            [b.block_id if isinstance(b, BlockStatus) else b for b in blocks]
        )


class NullBackend(MemoryBackend):
    """A tier that holds nothing: every store is refused (``prepare_store`` returns ``None``)."""

    def __init__(self, block_bytes: int = 0):
        super().__init__(0, block_bytes)

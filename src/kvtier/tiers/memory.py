"""The smallest working tier: rows in this process's memory. A test double and a template.

Copy this file to start a new tier: a SlotBackend needs a spec type for its medium and a
place for its rows, nothing else; the manager and the policy do the rest.
"""

from __future__ import annotations

import numpy as np

from kvtier.mediums import MemoryLoadStoreSpec
from kvtier.tiers.slots import SlotBackend

__all__ = ["MemoryBackend", "NullBackend"]


class MemoryBackend(SlotBackend):
    """``num_blocks`` rows of ``block_bytes`` in a private numpy array (not shared, not pinned)."""

    spec_type = MemoryLoadStoreSpec

    def __init__(self, num_blocks: int, block_bytes: int):
        super().__init__(block_bytes, num_blocks)
        self.rows = np.zeros((num_blocks, block_bytes), dtype=np.uint8)


class NullBackend(MemoryBackend):
    """A tier that holds nothing: every store is refused (``prepare_store`` returns ``None``)."""

    def __init__(self, block_bytes: int = 0):
        super().__init__(0, block_bytes)

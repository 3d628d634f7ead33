"""LoadStoreSpecs of the media kvtier moves blocks between: block ids into one tier's rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.base import LoadStoreSpec

__all__ = ["BlockIDsLoadStoreSpec", "GPULoadStoreSpec", "CPULoadStoreSpec", "MemoryLoadStoreSpec"]


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks named by their ids (rows) in one medium, kept as an ``np.int64`` array."""

    def __init__(self, block_ids: Iterable[int] | np.ndarray):
        self.block_ids = np.asarray(block_ids, dtype=np.int64)
        if self.block_ids.ndim != 1:
            raise ValueError(f"block_ids must be one-dimensional, got shape {self.block_ids.shape}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()!r})"

    def __len__(self) -> int:
        return len(self.block_ids)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the engine's GPU KV cache.

    With several KV groups, ``block_ids`` are ordered by group and ``group_sizes[i]`` of them
    belong to group ``i``. ``block_indices[i]``, when given, is the logical index (within the
    request) of group ``i``'s first block: a load may start in the middle of an offloaded block
    that spans several GPU blocks, and this says how many GPU blocks of it to skip.
    """

    def __init__(
        self,
        block_ids: Iterable[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int] | None = None,
    ):
        super().__init__(block_ids)
        if sum(group_sizes) != len(self.block_ids):
            raise ValueError(
                f"group_sizes {list(group_sizes)} add up to {sum(group_sizes)}, "
                f"but there are {len(self.block_ids)} block ids"
            )
        if block_indices is not None and len(block_indices) != len(group_sizes):
            raise ValueError(f"block_indices has {len(block_indices)} entries for {len(group_sizes)} groups")
        self.group_sizes = tuple(group_sizes)
        self.block_indices = None if block_indices is None else tuple(block_indices)

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of the CPU tier's shared region."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class MemoryLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of an in-process test tier (:class:`kvtier.testing.memory.MemoryBackend`)."""

    @staticmethod
    def medium() -> str:
        return "MEMORY"

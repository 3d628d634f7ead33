"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Drops the block used longest ago.

    One OrderedDict is both the index (key -> block id) and the recency list (oldest first):
    a second structure for the order would cost ~100 bytes per block, half the budget.
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._blocks: OrderedDict[OffloadKey, int] = OrderedDict()
        # Bound C methods: lookup runs once per key per request, and a Python-level wrapper
        # would double its cost. _blocks is only ever cleared in place, so they stay valid.
        self.get = self._blocks.get  # type: ignore[method-assign]
        self.contains = self._blocks.__contains__  # type: ignore[method-assign]

    def get(self, key: OffloadKey) -> int | None:  # replaced per instance in __init__
        return self._blocks.get(key)

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._blocks.update(zip(keys, block_ids))

    def remove(self, key: OffloadKey) -> int | None:
        return self._blocks.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        for key in keys:
            if key in blocks:
                move_to_end(key)

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        blocks = self._blocks
        if count > len(blocks):
            return None
        if not skip:
            # Nothing pinned or protected: the oldest `count` entries are the victims.
            popitem = blocks.popitem
            return [popitem(last=False) for _ in range(count)]
        victims = []
        for key in blocks:  # oldest first; choose before mutating, so failure changes nothing
            if key not in skip:
                victims.append(key)
                if len(victims) == count:
                    break
        else:
            return None
        pop = blocks.pop
        return [(key, pop(key)) for key in victims]

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._blocks)

    def clear(self) -> list[tuple[OffloadKey, int]]:
        dropped = list(self._blocks.items())
        self._blocks.clear()
        return dropped

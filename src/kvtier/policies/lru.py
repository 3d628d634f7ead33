"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Container, Iterable, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import IndexedPolicy, append_all, at_recent_end, tail_first

__all__ = ["LRUPolicy"]


class LRUPolicy(IndexedPolicy):
    """Drops the block used longest ago.

    Two structures: ``_index`` maps every ready key to its block id (``get`` and ``contains``
    are its C methods), and ``_order`` lists the keys that may be evicted, oldest first. A
    held key leaves ``_order`` and comes back at its recent end when released: the reads
    that hold a block are uses of it, and a block just saved below was wanted recently
    enough to be stored. Keeping held keys in the order instead (and passing over them) made
    each eviction walk past every pinned or unsaved block — thousands, in a write-back CPU
    tier — so a step's cost grew with the tier.

    Memory: about 50 bytes per key for the index and 105 for the order, with no object per
    block (an int per block id is shared with the Backend's free list).
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()
        self._parts = (self._order,)
        # a bound C method, like get and contains (see IndexedPolicy)
        self.hold = self._order.__delitem__  # type: ignore[method-assign,assignment]

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._index.update(zip(keys, block_ids))
        if len(keys) == 1:
            self._order[keys[0]] = None
        else:
            append_all(self._order, reversed(keys))  # the head most recent

    def insert_held(
        self, keys: Sequence[OffloadKey], block_ids: Sequence[int], held: Collection[OffloadKey]
    ) -> None:
        self._index.update(zip(keys, block_ids))
        if len(held) != len(keys):  # held is a subset of keys: equal sizes mean all of them
            append_all(self._order, [key for key in reversed(keys) if key not in held])

    def remove(self, key: OffloadKey) -> int | None:
        self._order.pop(key, None)
        return self._index.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        order = self._order
        move_to_end = order.move_to_end
        if at_recent_end(order, keys):
            return  # just stored or released, in this order: nothing to move
        if all(map(order.__contains__, keys)):  # none held or unknown: the loop in C
            deque(map(move_to_end, tail_first(keys)), 0)
            return
        for key in tail_first(keys):  # the head ends most recent: the tail leaves first
            if key in order:  # a held key is refreshed when it is released
                move_to_end(key)

    def refresh(self, keys: Collection[OffloadKey]) -> None:
        self.touch(keys)  # LRU counts no uses: a refresh is a touch

    def request_finished(self, keys: Collection[OffloadKey], reused: Collection[OffloadKey]) -> None:
        self.touch(keys)

    def hold(self, key: OffloadKey) -> None:  # replaced per instance in __init__
        del self._order[key]

    def release(self, key: OffloadKey) -> None:
        self._order[key] = None

    def hold_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        deque(map(self._order.__delitem__, keys), 0)  # the loop in C

    def release_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        append_all(self._order, keys)

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        return self.evict(count, protected)

    def evictable_blocks(self) -> int:
        return len(self._order)

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        order, index = self._order, self._index
        if count > len(order):
            return None
        if not skip:
            # Nothing to pass over: the oldest `count` entries are the victims.
            self.entries_visited += count
            popitem, pop = order.popitem, index.pop
            return [(key, pop(key)) for key, _ in (popitem(last=False) for _ in range(count))]
        victims = []
        visited = 0
        for key in order:  # oldest first; choose before mutating, so failure changes nothing
            visited += 1
            if key not in skip:
                victims.append(key)
                if len(victims) == count:
                    break
        self.entries_visited += visited
        if len(victims) < count:
            return None
        pop = index.pop
        for key in victims:
            del order[key]
        return [(key, pop(key)) for key in victims]

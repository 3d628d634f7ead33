"""SIEVE eviction (Zhang et al., NSDI'24): a FIFO queue and a hand that spares used blocks."""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import IndexedPolicy

__all__ = ["SIEVEPolicy"]


class SIEVEPolicy(IndexedPolicy):
    """Keeps blocks in arrival order; a hand walks from the oldest toward the newest.

    A hit only sets the block's *visited* bit; nothing moves. To evict, the hand passes over
    visited blocks (clearing their bit, so each is spared once per pass) and drops the first
    unvisited one, then stays where it stopped. New blocks enter at the newest end, behind the
    hand, so a block must be used before the hand comes round to keep its place. Unlike
    CLOCK, a spared block is not moved to the newest end: survivors stay among the old.

    The queue is a doubly linked list of keys kept in two dicts (``_newer``/``_older``), so
    unlinking a held or removed key from the middle is O(1). ``_visited`` is the set of
    visited ready keys. A held key leaves the list (eviction never passes it) and comes back
    at the newest end when released, with the visited bit it had: only ``touch`` is a use (a
    hold may be a save to a lower tier).

    Cost: each eviction clears at most one bit per block it passes, and a bit is set only by
    a use, so evictions cost O(1) amortized per victim.
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._newer: dict[OffloadKey, OffloadKey | None] = {}
        self._older: dict[OffloadKey, OffloadKey | None] = {}
        self._oldest: OffloadKey | None = None
        self._newest: OffloadKey | None = None
        self._hand: OffloadKey | None = None  # None: start from the oldest
        self._visited: set[OffloadKey] = set()
        self._parts = (self._newer, self._older, self._visited)

    def _link(self, key: OffloadKey) -> None:
        """Append ``key`` at the newest end."""
        newest = self._newest
        self._older[key] = newest
        self._newer[key] = None
        if newest is None:
            self._oldest = key
        else:
            self._newer[newest] = key
        self._newest = key

    def _unlink(self, key: OffloadKey) -> None:
        older = self._older.pop(key)
        newer = self._newer.pop(key)
        if older is None:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer is None:
            self._newest = older
        else:
            self._older[newer] = older
        if self._hand == key:
            self._hand = newer

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._index.update(zip(keys, block_ids))
        for key in reversed(keys):  # the head newest: the hand reaches the tail first
            self._link(key)

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._index.pop(key, None)
        if block_id is not None:
            if key in self._newer:
                self._unlink(key)
            self._visited.discard(key)
        return block_id

    def touch(self, keys: Collection[OffloadKey]) -> None:
        index = self._index
        self._visited.update(key for key in keys if key in index)

    def hold(self, key: OffloadKey) -> None:
        self._unlink(key)

    def release(self, key: OffloadKey) -> None:
        self._link(key)

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        return self.evict(count, protected)

    def evictable_blocks(self) -> int:
        return len(self._newer)

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        newer = self._newer
        skipped = sum(1 for key in skip if key in newer) if isinstance(skip, Collection) else 0
        if count > len(newer) - skipped:
            return None
        if not isinstance(skip, Collection):
            # Cannot count an opaque container up front: check by walking (rare path).
            if count > sum(1 for key in newer if key not in skip):
                return None
        visited, index = self._visited, self._index
        victims: list[tuple[OffloadKey, int]] = []
        key = self._hand if self._hand is not None else self._oldest
        walked = 0
        while len(victims) < count:
            assert key is not None  # the ring holds at least count unskipped keys (checked above)
            walked += 1
            following = newer[key]
            if following is None:
                following = self._oldest  # wrap round to the oldest
            if key in skip:
                pass
            elif key in visited:
                visited.discard(key)
            else:
                self._unlink(key)
                victims.append((key, index.pop(key)))
                if following == key:
                    following = self._oldest
            key = following
        self._hand = key
        self.entries_visited += walked
        return victims

    def clear(self) -> list[tuple[OffloadKey, int]]:
        dropped = super().clear()
        self._oldest = self._newest = self._hand = None
        return dropped

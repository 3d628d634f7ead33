"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import EvictionPolicy

__all__ = ["ARCPolicy"]


def _first_not_in(keys: Iterator[OffloadKey], skip: Container[OffloadKey]) -> OffloadKey | None:
    for key in keys:
        if key not in skip:
            return key
    return None


class ARCPolicy(EvictionPolicy):
    """Balances recency and frequency, and learns the balance from its own mistakes.

    Ready blocks live in ``t1`` (used once since they arrived) or ``t2`` (used again).
    Keys evicted from them are remembered, without data, in the ghost lists ``b1`` / ``b2``.
    A store of a key found in ``b1`` means t1 was too small: the target size ``p`` of t1 grows;
    one found in ``b2`` shrinks it. Eviction takes t1's oldest while t1 is above ``p``, else
    t2's oldest. A key stored again after a ghost hit goes straight to t2: it has now been
    wanted twice. Ghosts are bounded so that ``|t1| + |b1| <= c`` and the four lists together
    hold at most ``2c`` keys.

    Unlike a page cache, a tier sees a block "used" only on :meth:`touch` (a hit), never on
    insertion, so the first store of a key lands in t1 and a later hit promotes it.
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._p = 0.0
        self._t1: OrderedDict[OffloadKey, int] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    @property
    def target_t1_blocks(self) -> float:
        """The adaptive target size of t1 (``p`` in the paper)."""
        return self._p

    def get(self, key: OffloadKey) -> int | None:
        block_id = self._t1.get(key)
        return block_id if block_id is not None else self._t2.get(key)

    def contains(self, key: OffloadKey) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if not b1 and not b2:  # cold start / no history: skip the ghost probes
            t1.update(zip(keys, block_ids))
            return
        capacity = self.capacity_blocks
        for key, block_id in zip(keys, block_ids):
            if key in b1:
                self._p = min(capacity, self._p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[key] = block_id
            elif key in b2:
                self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[key] = block_id
            else:
                t1[key] = block_id
        self._trim_ghosts()

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._t1.pop(key, None)
        return block_id if block_id is not None else self._t2.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                t2[key] = t1.pop(key)

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        t1, t2 = self._t1, self._t2
        if count > len(t1) + len(t2):
            return None
        # Choose every victim first (iterators only read), so a failure changes nothing.
        left1, left2 = len(t1), len(t2)
        oldest1, oldest2 = iter(t1), iter(t2)
        from_t1: list[OffloadKey] = []
        from_t2: list[OffloadKey] = []
        for _ in range(count):
            prefer_t1 = left1 > 0 and (left1 > self._p or left2 == 0)
            key = _first_not_in(oldest1 if prefer_t1 else oldest2, skip)
            if key is not None:
                (from_t1 if prefer_t1 else from_t2).append(key)
            else:  # the preferred list has nothing evictable left: take from the other
                prefer_t1 = not prefer_t1
                key = _first_not_in(oldest1 if prefer_t1 else oldest2, skip)
                if key is None:
                    return None
                (from_t1 if prefer_t1 else from_t2).append(key)
            if prefer_t1:
                left1 -= 1
            else:
                left2 -= 1
        victims = [(key, t1.pop(key)) for key in from_t1]
        victims += [(key, t2.pop(key)) for key in from_t2]
        self._b1.update(dict.fromkeys(from_t1))
        self._b2.update(dict.fromkeys(from_t2))
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        capacity = self.capacity_blocks
        b1, b2 = self._b1, self._b2
        while b1 and len(self._t1) + len(b1) > capacity:
            b1.popitem(last=False)
        while b2 and len(self._t1) + len(self._t2) + len(b1) + len(b2) > 2 * capacity:
            b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[OffloadKey]:
        yield from self._t1
        yield from self._t2

    def clear(self) -> list[tuple[OffloadKey, int]]:
        dropped = list(self._t1.items()) + list(self._t2.items())
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.clear()
        self._p = 0.0
        return dropped

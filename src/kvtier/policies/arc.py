"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) eviction."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Container, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import TwoQueuePolicy, append_all, at_recent_end, drop_oldest, tail_first

__all__ = ["ARCPolicy"]


class ARCPolicy(TwoQueuePolicy):
    """Balances recency and frequency, and learns the balance from its own mistakes.

    Ready blocks live in ``t1`` (used once since they arrived) or ``t2`` (used again).
    Keys evicted from them are remembered, without data, in the ghost lists ``b1`` / ``b2``.
    A store of a key found in ``b1`` means t1 was too small: the target size ``p`` of t1 grows;
    one found in ``b2`` shrinks it. Eviction takes t1's oldest while t1 is above ``p``, else
    t2's oldest. A key stored again after a ghost hit goes straight to t2: it has now been
    wanted twice. Ghosts are bounded so that ``|t1| + |b1| <= c`` and the four lists together
    hold at most ``2c`` keys.

    Unlike a page cache, a tier sees a block "used" only on :meth:`touch` or as a reused key
    of :meth:`request_finished` (loaded, or offered again while present), never on insertion,
    so the first store of a key lands in t1 and a later use promotes it; :meth:`refresh`
    moves a key up its own list only. Keys of one call are laid tail first (the head most
    recent), as vLLM 0.33's ARC orders a request's keys at its end.

    Held keys leave ``t1``/``t2`` (so eviction never walks past them) but still count in the
    list they belong to, for ``p`` and the ghost bounds; ``_held_t2`` names the held keys
    whose list is t2 (a held key touched moves there), and a released key returns to the
    recent end of its list. ``_index`` maps every ready key to its block id.
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._p = 0.0
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._held_t2: set[OffloadKey] = set()
        # the names TwoQueuePolicy's holds work on
        self._first, self._second, self._held_second = self._t1, self._t2, self._held_t2
        self._parts = (self._t1, self._t2, self._b1, self._b2, self._held_t2)

    @property
    def target_t1_blocks(self) -> float:
        """The adaptive target size of t1 (``p`` in the paper)."""
        return self._p

    def describe(self) -> dict[str, float]:
        return {"target_t1_blocks": self._p}

    def _sizes(self) -> tuple[int, int]:
        """|t1| and |t2| as ARC counts them: held keys included, in their own list."""
        size2 = len(self._t2) + len(self._held_t2)
        return len(self._index) - size2, size2

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        t1, b1, b2, index = self._t1, self._b1, self._b2, self._index
        if len(keys) == 1:  # the engine's common store: one block per request and step
            key = keys[0]
            index[key] = block_ids[0]
            if not (b1 and key in b1) and not (b2 and key in b2):
                t1[key] = None
                if b1 and len(index) - len(self._t2) - len(self._held_t2) + len(b1) > self.capacity_blocks:
                    self._trim_ghosts()  # t1 grew into b1's share
                return
        else:
            index.update(zip(keys, block_ids))
            if not (b1 or b2) or (b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys)):
                # no ghost among them (the probes run in C): all are new to t1
                append_all(t1, reversed(keys))  # the head most recent
                if b1:
                    self._trim_ghosts()
                return
        t2, capacity = self._t2, self.capacity_blocks
        for key in reversed(keys):
            if key in b1:
                self._p = min(capacity, self._p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None
        self._trim_ghosts()

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._index.pop(key, None)
        if block_id is not None:
            if self._t1.pop(key, 0) is not None:  # held, or in t2
                if self._t2.pop(key, 0) is not None:
                    self._held_t2.discard(key)
        return block_id

    def touch(self, keys: Collection[OffloadKey]) -> None:
        t1, t2, index = self._t1, self._t2, self._index
        for key in tail_first(keys):  # the head ends most recent
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None
            elif key in index:  # held: used again, so it goes back to t2
                self._held_t2.add(key)

    def refresh(self, keys: Collection[OffloadKey]) -> None:
        # Recency within its own list: a store is no second use, so t1 stays t1.
        t1, t2 = self._t1, self._t2
        if at_recent_end(t1, keys) or at_recent_end(t2, keys):
            return  # just stored or released, in this order: nothing to move
        if all(map(t1.__contains__, keys)):  # a request's own new blocks: the loop in C
            deque(map(t1.move_to_end, tail_first(keys)), 0)
            return
        for key in tail_first(keys):
            if key in t1:
                t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def request_finished(self, keys: Collection[OffloadKey], reused: Collection[OffloadKey]) -> None:
        # One pass, tail first: a reused key is one use (t1 -> t2), any other key only
        # moves up its own list (what vLLM 0.33's ARC does at a request's end).
        t1, t2, index = self._t1, self._t2, self._index
        if not reused:
            self.refresh(keys)
            return
        if len(reused) == len(keys):  # every key reused (reused is a subset of keys)
            if at_recent_end(t2, keys):
                return  # a read's blocks, sent to t2 by its release, in this order
            if all(map(t2.__contains__, keys)):
                # a read's blocks, sent to t2 when the read ended (hold_all(read=True))
                deque(map(t2.move_to_end, tail_first(keys)), 0)
                return
            if all(map(t1.__contains__, keys)):
                ordered = list(tail_first(keys))
                deque(map(t1.__delitem__, ordered), 0)
                append_all(t2, ordered)
                return
        for key in tail_first(keys):
            if key in t1:
                if key in reused:
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in reused and key in index:  # held: back to t2 when released
                self._held_t2.add(key)

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        t1, t2 = self._t1, self._t2
        if count > len(t1) + len(t2):
            return None
        left1, left2 = self._sizes()
        if not skip:
            return self._evict_oldest(count, left1, left2)
        # Choose every victim first (iterators only read), so a failure changes nothing.
        oldest = (iter(t1), iter(t2))
        chosen: tuple[list[OffloadKey], list[OffloadKey]] = ([], [])
        visited = 0
        for _ in range(count):
            prefer = 0 if left1 > 0 and (left1 > self._p or left2 == 0) else 1
            for side in (prefer, 1 - prefer):  # the other list if the preferred has none left
                key = None
                for candidate in oldest[side]:
                    visited += 1
                    if candidate not in skip:
                        key = candidate
                        break
                if key is not None:
                    chosen[side].append(key)
                    if side == 0:
                        left1 -= 1
                    else:
                        left2 -= 1
                    break
            else:
                self.entries_visited += visited
                return None
        self.entries_visited += visited
        from_t1, from_t2 = chosen
        pop = self._index.pop
        for key in from_t1:
            del t1[key]
        for key in from_t2:
            del t2[key]
        victims = [(key, pop(key)) for key in from_t1] + [(key, pop(key)) for key in from_t2]
        append_all(self._b1, from_t1)
        append_all(self._b2, from_t2)
        self._trim_ghosts()
        return victims

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        if protected:
            return self.evict(count, protected)
        # The manager's common call (nothing of the offer present): straight to the count.
        if count > len(self._t1) + len(self._t2):
            return None
        size2 = len(self._t2) + len(self._held_t2)
        return self._evict_oldest(count, len(self._index) - size2, size2)

    def _evict_oldest(self, count: int, left1: int, left2: int) -> list[tuple[OffloadKey, int]]:
        """:meth:`evict` with nothing to pass over: the same choice, made by counting (each
        victim is the oldest of its list), then popped."""
        t1, t2, p = self._t1, self._t2, self._p
        self.entries_visited += count
        pop = self._index.pop
        if count == 1:  # one block per store: no counting loop, no lists to join
            # as the loop below decides it: ARC's preferred list, else the one not empty
            if bool(t1) if left1 > 0 and (left1 > p or left2 == 0) else not t2:
                key = t1.popitem(False)[0]
                self._b1[key] = None
            else:
                key = t2.popitem(False)[0]
                self._b2[key] = None
            victims = [(key, pop(key))]
            self._trim_ghosts()
            return victims
        room1, room2 = len(t1), len(t2)
        if count <= room1 and left1 - count >= p:
            # t1 stays above its target to the last victim: every victim is t1's oldest
            pop1 = t1.popitem
            oldest = [pop1(False)[0] for _ in range(count)]
            victims = list(zip(oldest, map(pop, oldest)))
            append_all(self._b1, oldest)
            self._trim_ghosts()
            return victims
        take1 = take2 = 0
        for _ in range(count):
            if left1 > 0 and (left1 > p or left2 == 0):  # ARC prefers t1
                from_t1 = take1 < room1
            else:
                from_t1 = take2 >= room2
            if from_t1:
                take1 += 1
                left1 -= 1
            else:
                take2 += 1
                left2 -= 1
        pop1, pop2 = t1.popitem, t2.popitem
        keys1 = [pop1(False)[0] for _ in range(take1)]
        keys2 = [pop2(False)[0] for _ in range(take2)]
        victims = [(key, pop(key)) for key in keys1] + [(key, pop(key)) for key in keys2]
        append_all(self._b1, keys1)
        append_all(self._b2, keys2)
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts past ARC's bounds: |t1| + |b1| <= c, all four <= 2c."""
        capacity = self.capacity_blocks
        b1, b2 = self._b1, self._b2
        ready = len(self._index)
        over = ready - len(self._t2) - len(self._held_t2) + len(b1) - capacity
        if over > 0 and b1:
            drop_oldest(b1, over)
        over = ready + len(b1) + len(b2) - 2 * capacity
        if over > 0 and b2:
            drop_oldest(b2, over)

    def clear(self) -> list[tuple[OffloadKey, int]]:
        dropped = super().clear()
        self._p = 0.0
        return dropped

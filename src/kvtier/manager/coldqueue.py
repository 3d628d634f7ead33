"""The blocks a stack manager still has to write below, coldest first."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

from kvtier.base import OffloadKey
from kvtier.policies.base import tail_first

__all__ = ["ColdQueue"]


class ColdQueue(set):
    """A set of keys that also knows their recency: :meth:`pop_coldest` takes the least
    recently stored or used first, without walking anything.

    The set itself holds the members, so ``key in queue`` is one C-level probe of one table
    (a dict of copy counts needs two: its index, then its entries; at 10^6 blocks each is a
    cache miss). Beside it, ``_order`` lists the keys coldest first, and a key that
    :meth:`refresh` makes warm again is appended once more rather than searched for: its
    older copy is passed over once where it is popped, which the refresh paid for.
    ``_extra`` counts those older copies, and only for keys refreshed while waiting (a
    handful), so a waiting block costs a set slot and a deque slot: about 30 bytes.

    Add keys with :meth:`add_new` and take them with :meth:`pop_coldest` or :meth:`clear`:
    the set's own ``add``/``remove`` would leave ``_order`` behind (a key removed that way is
    only skipped when its copies come up).

    Who calls it: the owning manager, on the scheduler thread; every call O(keys named +
    entries popped).
    """

    __slots__ = ("_order", "_extra")

    def __init__(self) -> None:
        super().__init__()
        self._order: deque[OffloadKey] = deque()
        self._extra: dict[OffloadKey, int] = {}

    def add_new(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` (none a member; one request's, head first) start waiting, as the warmest,
        the head warmest of all: a prefix's tail is saved, and so released, first."""
        self.update(keys)
        self._order.extend(tail_first(keys))

    def refresh(self, keys: Iterable[OffloadKey]) -> None:
        """The members among ``keys`` (head first) were used: they move to the warm end, the
        head warmest."""
        if self:
            refreshed = [key for key in tail_first(keys) if key in self]
            if refreshed:
                extra = self._extra
                for key in refreshed:
                    extra[key] = extra.get(key, 0) + 1
                self._order.extend(refreshed)

    def pop_coldest(self, count: int) -> tuple[list[OffloadKey], int]:
        """Take up to ``count`` of the coldest members out; those keys, and how many entries
        of the order were examined (the popped keys plus the stale copies passed over)."""
        order, extra = self._order, self._extra
        popleft, remove = order.popleft, self.remove
        keys: list[OffloadKey] = []
        visited = 0
        while len(keys) < count and order:
            key = popleft()
            visited += 1
            copies = extra.get(key) if extra else None
            if copies:  # used since: its later copy is where it belongs
                if copies == 1:
                    del extra[key]
                else:
                    extra[key] = copies - 1
            elif key in self:
                remove(key)
                keys.append(key)
        return keys, visited

    def clear(self) -> None:
        super().clear()
        self._order.clear()
        self._extra.clear()

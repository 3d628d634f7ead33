"""The interface every eviction policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Collection, Container, Iterable, Iterator, Sequence
from itertools import islice, repeat, starmap
from operator import eq
from typing import Any

from kvtier.base import OffloadKey

__all__ = [
    "EvictionPolicy",
    "IndexedPolicy",
    "TwoQueuePolicy",
    "append_all",
    "at_recent_end",
    "drop_oldest",
    "tail_first",
]


def at_recent_end(order: OrderedDict[OffloadKey, None], keys: Collection[OffloadKey]) -> bool:
    """Whether ``keys`` (head first) are already the most recent entries of ``order``, the head
    newest: then refreshing them would change nothing. One walk of the order's newest end in
    C, stopping at the first difference, and no hash probe: cheaper than moving them, which
    is what a request that only stored or only read finds at its end."""
    count = len(keys)
    return 0 < count <= len(order) and all(map(eq, islice(reversed(order), count), keys))


def append_all(order: OrderedDict[OffloadKey, None], keys: Iterable[OffloadKey]) -> None:
    """Add ``keys`` at the recent end of ``order``, in order (keys already there keep their
    place): the loop in C. ``order.update(dict.fromkeys(keys))`` does the same but builds a
    dict first, 45 ns a key more (measured 2026-11-28)."""
    deque(map(order.__setitem__, keys, repeat(None)), 0)


def drop_oldest(order: OrderedDict[OffloadKey, None], count: int) -> None:
    """Drop the ``count`` oldest entries of ``order`` (at most all of them): the loop in C."""
    deque(starmap(order.popitem, repeat((False,), min(count, len(order)))), 0)


def tail_first(keys: Iterable[OffloadKey]) -> Iterable[OffloadKey]:
    """``keys`` (one request's, head first) from its tail to its head: the order to append
    them to a recency order so that the head ends most recent. A set has no order to
    reverse and comes back as it is."""
    try:
        return reversed(keys)  # type: ignore[call-overload]
    except TypeError:
        return keys


class EvictionPolicy(ABC):
    """The ready blocks of one tier, in the order the policy would drop them.

    A policy maps each ready key to its block id (the slot in the tier's Backend) and decides
    which keys to evict when the manager needs room. It knows nothing of blocks being written.
    A ready block that must stay put (a read in flight, a block not yet saved below) is
    *held*: the manager calls :meth:`hold` when the first reason appears and :meth:`release`
    when the last one goes; a held key stays visible to :meth:`get` and :meth:`contains` but
    is never a victim.

    Who calls it: the owning manager only, on the engine's scheduler thread; never blocks.

    **Order within a call.** The keys one call names (:meth:`insert`, :meth:`touch`,
    :meth:`refresh`) are one request's, in prefix order: head first. A block is only useful
    while every block before it in its prefix is cached, so the policy must leave the *head*
    the most recent of them (where it keeps an order at all): their tail is evicted first.
    vLLM 0.33's policies do the same (they walk a request's keys in reverse).

    The manager guarantees: :meth:`insert` names keys not present; :meth:`remove` and
    :meth:`touch` may name unknown keys (ignored); :meth:`hold` names a ready key not held,
    :meth:`release` a held one. The implementation must: make :meth:`evict` all-or-nothing,
    never return a held key nor a key in ``skip``, and forget evicted keys as live blocks
    (ghost entries — keys only — that only steer future decisions are fine, up to a small
    constant multiple of ``capacity_blocks``).

    Speed matters, because the manager runs inside the engine's scheduler every step: each
    method must cost O(keys it names + victims it returns), whatever the number of blocks
    held or stored. The built-in policies keep held keys out of their eviction order, so
    :meth:`evict` never walks past one. The defaults of :meth:`hold`, :meth:`release` and
    :meth:`evictable_blocks` keep an out-of-tree policy that ignores holds correct, not fast:
    they hand :meth:`evict` every held key as ``skip``. :meth:`contains` runs once per
    ``lookup``; a subclass may bind it in ``__init__`` to a C-level method
    (``self.contains = some_dict.__contains__``), which is why the manager calls
    ``policy.contains`` rather than ``key in policy``.

    ``entries_visited`` counts the entries :meth:`evict` examined since creation, chosen or
    passed over; the tests read it to prove a step's cost does not grow with the tier.
    """

    def __init__(self, capacity_blocks: int):
        #: the most ready blocks the tier can hold (ghost lists are sized from it)
        self.capacity_blocks = capacity_blocks
        #: entries :meth:`evict` examined since creation (a cost counter, not a statistic)
        self.entries_visited = 0
        # Only the fallback hold tracking of the defaults below uses this.
        self._held_fallback: set[OffloadKey] = set()

    @abstractmethod
    def get(self, key: OffloadKey) -> int | None:
        """The block id of ready ``key`` (held or not), or ``None``."""

    def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` is a ready block of the tier (held or not)."""
        return self.get(key) is not None

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """``keys`` became ready in slots ``block_ids`` (same order); none was present."""

    def insert_held(
        self, keys: Sequence[OffloadKey], block_ids: Sequence[int], held: Collection[OffloadKey]
    ) -> None:
        """:meth:`insert`, with the keys of ``keys`` that are in ``held`` held at once.

        A write-back tier's new blocks are held from the moment they are ready (not saved
        below yet), so a policy that keeps held keys out of its order can skip putting them
        in it, only to take them out again. ``held`` is a subset of ``keys``; the default
        inserts, then holds each.
        """
        self.insert(keys, block_ids)
        if not isinstance(held, (set, frozenset, dict)):
            held = set(held)  # a list would make each membership test a scan
        for key in keys:
            if key in held:
                self.hold(key)

    @abstractmethod
    def remove(self, key: OffloadKey) -> int | None:
        """Forget ``key`` (held or not); its block id, or ``None`` if it was not present."""

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` were used (hit, loaded or found in the GPU cache); refresh them, the first
        the most recent, and count the use where the policy counts uses."""

    def refresh(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` were named by a request without being used again (stored by it, or all
        its keys when it finishes): make them recent, the first the most recent, without
        counting a use. Unknown and held keys are ignored. The default does nothing: right
        for a policy whose order is arrival only (FIFO, SIEVE)."""

    def request_finished(self, keys: Collection[OffloadKey], reused: Collection[OffloadKey]) -> None:
        """A request finished: ``keys`` are every key it named (prefix order, head first;
        some may be gone or held), ``reused`` those it found ready and used (loaded, or
        offered again while present). One use of each reused key, then every key recent, the
        head most recent — as vLLM 0.33's manager does at ``on_request_finished``.

        The default is :meth:`touch` of the reused keys, then :meth:`refresh` of all.
        """
        used = [key for key in keys if key in reused]
        if used:
            self.touch(used)
        self.refresh(keys)

    @abstractmethod
    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Drop ``count`` ready blocks neither held nor in ``skip``; their ``(key, block id)`` pairs.

        ``skip`` is small (the ready keys of one offer). ``None`` if fewer than ``count``
        blocks may be dropped; then nothing changed.
        """

    def hold(self, key: OffloadKey) -> None:
        """Ready ``key`` must not be evicted until :meth:`release` names it."""
        self._held_fallback.add(key)

    def release(self, key: OffloadKey) -> None:
        """Held ``key`` may be evicted again."""
        self._held_fallback.discard(key)

    def hold_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        """:meth:`hold` each of ``keys`` (distinct, ready, none held), in order; a policy may
        do it in bulk (a read of 64 blocks is one call, not 64). ``read``: the hold is a
        request reading them, which its end counts as a use (``request_finished``), and the
        manager releases them with :meth:`release_all` ``read=True`` too; a policy that
        moves used blocks to another list may send them there on that release already, so
        that the end only refreshes them. The default ignores it."""
        for key in keys:
            self.hold(key)

    def release_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        """:meth:`release` each of ``keys`` (distinct, held), in order: the last released
        ends the most recent. ``read``: they were held by :meth:`hold_all` ``read=True``."""
        for key in keys:
            self.release(key)

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        """What the manager calls: :meth:`evict` passing over held keys and ``protected``.

        A policy that keeps held keys out of its order overrides this to skip the union.
        """
        held = self._held_fallback
        return self.evict(count, held.union(protected) if protected else held)

    def evictable_blocks(self) -> int:
        """How many ready blocks are not held (the most :meth:`evict` could drop)."""
        return len(self) - len(self._held_fallback)

    @abstractmethod
    def __len__(self) -> int:
        """How many ready blocks the policy holds, held ones included."""

    @abstractmethod
    def __iter__(self) -> Iterator[OffloadKey]:
        """The ready keys, in no promised order."""

    def describe(self) -> dict[str, float]:
        """What the policy has learnt, for the manager's ``stats()`` (``policy_<name>``): a
        policy that adapts says where it stands; the default has nothing to say."""
        return {}

    def clear(self) -> list[tuple[OffloadKey, int]]:
        """Forget every block (and any history, and every hold); the ``(key, block id)`` pairs."""
        dropped = [(key, self.get(key)) for key in list(self)]
        for key, _ in dropped:
            self.remove(key)
        self._held_fallback.clear()
        return dropped  # type: ignore[return-value]


class IndexedPolicy(EvictionPolicy):
    """A policy that maps every ready key to its block id in one dict, ``_index``.

    ``get``, ``contains``, the length, iteration and :meth:`clear` all come from it. ``get``
    and ``contains`` are bound to the dict's own C methods per instance: lookup runs once per
    key per request, and a Python-level wrapper would double its cost (``_index`` is only ever
    cleared in place, so they stay valid). A subclass names its other containers in
    ``_parts`` (set in its ``__init__``), which :meth:`clear` empties too, and extends
    :meth:`clear` for any other state.
    """

    _parts: tuple[Any, ...] = ()

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._index: dict[OffloadKey, int] = {}
        self.get = self._index.get  # type: ignore[method-assign,assignment]
        self.contains = self._index.__contains__  # type: ignore[method-assign,assignment]

    def get(self, key: OffloadKey) -> int | None:  # replaced per instance in __init__
        return self._index.get(key)

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._index)

    def clear(self) -> list[tuple[OffloadKey, int]]:
        dropped = list(self._index.items())
        self._index.clear()
        for part in self._parts:
            part.clear()
        self._held_fallback.clear()
        return dropped


class TwoQueuePolicy(IndexedPolicy):
    """Holds for a policy whose evictable blocks sit in two ordered queues: ``_first`` (blocks
    new to the tier: ARC's t1, S3-FIFO's small queue, chain's probation) and ``_second``
    (blocks used again: t2, main, protected).

    A held block leaves its queue; one taken from the second queue is remembered in
    ``_held_second`` so that :meth:`release` puts it back there (as just used), and the
    policy can count it in that queue's share while it is held. Eviction then never meets a
    held key, so :meth:`evict_unheld` needs no skip set beyond ``protected``. A subclass
    creates the three containers in ``__init__`` and never rebinds them.
    """

    _first: OrderedDict[OffloadKey, None]
    _second: OrderedDict[OffloadKey, None]
    _held_second: set[OffloadKey]

    def hold(self, key: OffloadKey) -> None:
        if self._first.pop(key, 0) is not None:  # values are None: 0 means not in _first
            del self._second[key]
            self._held_second.add(key)

    def release(self, key: OffloadKey) -> None:
        if key in self._held_second:
            self._held_second.remove(key)
            self._second[key] = None
        else:
            self._first[key] = None

    #: whether a use moves a block from the first queue to the second (ARC, chain; not
    #: S3-FIFO, which only counts it): then a read's blocks go back to the second queue
    _use_moves_to_second = True

    def hold_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        ordered = keys if isinstance(keys, (list, tuple, dict)) else list(keys)
        # A read's keys need no note of their queue: the read's release puts them in the
        # second queue whatever it was (see _use_moves_to_second).
        to_second = read and self._use_moves_to_second
        if len(ordered) == 1:  # one block: the per-key calls are cheaper than the bulk ones
            for key in ordered:
                if not to_second:
                    self.hold(key)
                elif self._first.pop(key, 0) is not None:  # values are None: 0 = absent
                    del self._second[key]
            return
        popped = list(map(self._first.pop, ordered, repeat(0)))
        if popped.count(None) == len(popped):
            return  # all were in the first queue
        in_second = [key for key, value in zip(ordered, popped) if value is not None]
        second = self._second
        for key in in_second:
            del second[key]
        if not to_second:
            self._held_second.update(in_second)

    def release_all(self, keys: Iterable[OffloadKey], read: bool = False) -> None:
        ordered = keys if isinstance(keys, (list, tuple)) else list(keys)
        held_second = self._held_second
        if read and self._use_moves_to_second:
            if held_second:
                held_second.difference_update(ordered)  # touched while held: noted there
            if len(ordered) == 1:
                self._second[ordered[0]] = None
            else:
                append_all(self._second, ordered)
            return
        if len(ordered) == 1:
            self.release(ordered[0])
            return
        if not held_second:  # none belongs to the second queue: all back to the first
            append_all(self._first, ordered)
            return
        release = self.release
        for key in ordered:
            release(key)

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        return self.evict(count, protected)

    def evictable_blocks(self) -> int:
        return len(self._first) + len(self._second)

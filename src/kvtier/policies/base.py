"""The interface every eviction policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Iterator, Sequence

from kvtier.base import OffloadKey

__all__ = ["EvictionPolicy"]


class EvictionPolicy(ABC):
    """The ready blocks of one tier, in the order the policy would drop them.

    A policy maps each ready key to its block id (the slot in the tier's Backend) and decides
    which keys to evict when the manager needs room. It knows nothing of blocks being written
    or of pins: the manager keeps those, and tells :meth:`evict` which keys to pass over.

    Who calls it: the owning manager only, on the engine's scheduler thread; never blocks.

    The manager guarantees: :meth:`insert` names keys not present; :meth:`remove` and
    :meth:`touch` may name unknown keys (ignored). The implementation must: make :meth:`evict`
    all-or-nothing, never return a key in ``skip``, and forget evicted keys as live blocks
    (ghost entries that only steer future decisions are fine, within ``capacity_blocks``).

    Speed matters: :meth:`contains` runs once per ``lookup``. A subclass may bind it in
    ``__init__`` to a C-level method (``self.contains = some_dict.__contains__``), which is why
    the manager calls ``policy.contains`` rather than ``key in policy``.
    """

    def __init__(self, capacity_blocks: int):
        #: the most ready blocks the tier can hold (ghost lists are sized from it)
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def get(self, key: OffloadKey) -> int | None:
        """The block id of ready ``key``, or ``None``."""

    def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` is a ready block of the tier."""
        return self.get(key) is not None

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """``keys`` became ready in slots ``block_ids`` (same order); none was present."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> int | None:
        """Forget ``key``; its block id, or ``None`` if it was not present."""

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` were used (hit, loaded or found in the GPU cache); refresh them."""

    @abstractmethod
    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """Drop ``count`` ready blocks not in ``skip``; their ``(key, block id)`` pairs.

        ``None`` if fewer than ``count`` blocks may be dropped; then nothing changed.
        """

    @abstractmethod
    def __len__(self) -> int:
        """How many ready blocks the policy holds."""

    @abstractmethod
    def __iter__(self) -> Iterator[OffloadKey]:
        """The ready keys, in no promised order."""

    def clear(self) -> list[tuple[OffloadKey, int]]:
        """Forget every block (and any history); the ``(key, block id)`` pairs dropped."""
        dropped = [(key, self.get(key)) for key in list(self)]
        for key, _ in dropped:
            self.remove(key)
        return dropped  # type: ignore[return-value]

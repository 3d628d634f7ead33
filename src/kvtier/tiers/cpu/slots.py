"""Fixed-size slot allocation shared by every tier whose blocks live in numbered rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvtier.base import Backend, BlockStatus, OffloadKey
from kvtier.errors import BlockStateError
from kvtier.mediums import BlockIDsLoadStoreSpec

__all__ = ["SlotAllocator", "SlotBackend"]


class SlotAllocator:
    """Hands out slot ids ``0..num_slots-1`` and takes them back; guards against double frees.

    Who calls it: a Backend, on the scheduler thread; not thread-safe on its own, never blocks.
    It sits on the scheduler's hot path: a slot is an ``int``, allocation and release are list
    slices, and the per-slot bookkeeping is one byte.

    Slot ids are ``int`` objects made once here and handed out and taken back as the same
    objects, so a manager that keeps them in its index stores a reference, not a new int per
    block.
    """

    def __init__(self, num_slots: int, *, what: str = "block"):
        self.num_slots = num_slots
        self._what = what
        # Descending, because allocation takes from the end: a fresh allocator hands out
        # 0, 1, 2, ... and a freed slot is the next one reused (its pages are already faulted
        # in and pinned). A deque or heap would cost a Python call per id.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # One in-use flag per slot, twice as long as needed: a negative id indexes the upper
        # half, which is never set, so it reads as "not allocated" without a sign check per id.
        self._in_use = bytearray(2 * num_slots)

    def num_free(self) -> int:
        """How many slots :meth:`allocate` can hand out now. O(1)."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free slots; a fresh allocator hands out ``0, 1, 2, ...``.

        The caller checked :meth:`num_free`; asking for more raises :class:`BlockStateError`
        and takes nothing.
        """
        free = self._free
        if not 0 < count <= len(free):
            if count == 0:
                return []  # also: free[-0:] below would mean the whole list
            raise BlockStateError(
                f"cannot allocate {count} {self._what}s: {len(free)} of {self.num_slots} are "
                f"free (check get_num_free_blocks() first)"
            )
        slot_ids = free[: -count - 1 : -1]
        del free[-count:]
        in_use = self._in_use
        for slot_id in slot_ids:
            # Cannot fire while free() guards the list, so it only catches outside tampering
            # with it; the allocator is not worth saving then, only stopping.
            if in_use[slot_id]:
                raise BlockStateError(f"{self._what} {slot_id} is on the free list but in use")
            in_use[slot_id] = 1
        return slot_ids

    def free(self, slot_ids: Iterable[int]) -> None:
        """Give back slots from :meth:`allocate`.

        Freeing a slot twice, or one never allocated, raises :class:`BlockStateError` and
        frees none of ``slot_ids``. The caller guarantees no transfer still uses them.
        """
        ids = slot_ids if type(slot_ids) is list else list(slot_ids)
        in_use = self._in_use
        done = 0
        try:
            for done, slot_id in enumerate(ids):  # noqa: B007 - `done` is read on failure
                if in_use[slot_id] != 1:
                    raise BlockStateError(
                        f"{self._what} {slot_id!r} is not allocated (freed twice, or never handed out here)"
                    )
                in_use[slot_id] = 0
        except (IndexError, TypeError) as exc:
            self._undo_free(ids, done)
            raise BlockStateError(
                f"{ids[done]!r} is not a {self._what} id here (0..{self.num_slots - 1})"
            ) from exc
        except BlockStateError:
            self._undo_free(ids, done)
            raise
        self._free.extend(ids)

    def _undo_free(self, ids: list[int], failed_at: int) -> None:
        for slot_id in ids[:failed_at]:
            self._in_use[slot_id] = 1


class SlotBackend(Backend):
    """A Backend whose blocks are numbered rows: the slots come from a :class:`SlotAllocator`.

    A subclass names its spec type (``spec_type``, whose ``medium()`` is the backend's medium)
    and creates ``self._slots``; allocation, release and specs are shared.
    """

    spec_type: type[BlockIDsLoadStoreSpec]

    def __init__(self, block_bytes: int, num_blocks: int, *, what: str = "block"):
        super().__init__(block_bytes, self.spec_type.medium())
        self._slots = SlotAllocator(num_blocks, what=what)

    def get_num_free_blocks(self) -> int:
        return self._slots.num_free()

    def allocate_block_ids(self, count: int) -> list[int]:
        return self._slots.allocate(count)

    def free_block_ids(self, block_ids: Iterable[int]) -> None:
        self._slots.free(block_ids)

    def get_load_store_spec(
        self, keys: Iterable[OffloadKey], blocks: Iterable[int] | Iterable[BlockStatus]
    ) -> BlockIDsLoadStoreSpec:
        """Where ``keys`` live: their slot ids, as ints or as contract ``BlockStatus`` objects.

        ``keys`` are not needed: a spec names rows, and the caller keeps the order of ``keys``
        and ``blocks`` the same.
        """
        if isinstance(blocks, np.ndarray):
            return self.spec_type(blocks)
        # ints or BlockStatus objects, told apart by the first
        block_list: Sequence[Any] = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        if block_list and isinstance(block_list[0], BlockStatus):
            block_list = [block.block_id for block in block_list]
        return self.spec_type(block_list)

"""SGLang's host pool as kvtier's CPU rows: in place where a page's bytes allow, else staged.

kvtier's lower tiers copy blocks between a ``(num_rows, block_bytes)`` uint8 array and their
medium. SGLang's host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` ...) keeps
pages in one of several layouts; which ones a tier can read and write in place is found from
the pool itself, by asking it (``get_data_page(index, flat=False)``) where pages 0, 1 and the
last one lie:

* a page that is one contiguous run of bytes, at one stride from the next (MLA in
  ``page_first`` and ``page_first_direct``): one block per page, the rows are the pool;
* a page whose two halves (K, then V) are each contiguous, the V half at a fixed distance from
  the K half (MHA in ``page_first``, ``page_first_direct``, ``page_head``): two blocks per
  page, the rows are the pool's K pages followed by its V pages;
* anything else (``layer_first``, where a page is spread over every layer): each page is
  copied through a small staging buffer (``kvtier_staging_pages`` pages) in its flat form,
  the one copy SGLang's own file backend makes too.

A page's flat form (``get_data_page(index, flat=True)``) is its parts one after the other, so
a pool opened with ``in_place=False`` (SGLang without ``interface_v1``, which hands the backend
flat pages rather than host slots) stages each page as the same blocks, one staging row per
part: the blocks on the medium are those an in-place pool writes.

Who uses it: :class:`~kvtier.integrations.sglang.storage.KvtierHiCacheStorage`, from SGLang's
storage threads; staging slots are handed out under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PageRows"]

_PAGE = 4096


def _address(tensor: Any) -> int:
    return int(tensor.data_ptr())


class PageRows:
    """The rows kvtier's tiers see, and where each page (and part of it) is among them.

    ``parts``: blocks per page (1 or 2); ``block_bytes``: bytes of one block; ``staged``:
    pages are copied through the staging buffer (its slots, ``parts`` rows each) rather than
    read and written in place; ``flat``: a block is a whole page in its flat form (a layout
    whose parts do not lie at fixed strides).
    """

    def __init__(self, pool: Any, staging_pages: int, *, in_place: bool = True):
        self.pool = pool
        self.page_size = int(pool.page_size)
        self._lock = threading.Condition()
        found = self._in_place(pool)
        self.flat = found is None
        if found is not None and in_place:
            self.rows, self.parts, self._page_num = found
            self.staged = False
            self._free: list[int] = []
            self._slots = 0
        else:
            import torch

            if found is not None:
                self.parts, block_bytes = found[1], int(found[0].shape[1])
            else:
                flat = pool.get_dummy_flat_data_page()
                self.parts, block_bytes = 1, flat.numel() * flat.element_size()
            # rows on 4 KiB pages, 4 KiB apart: the tiers can then read and write them with O_DIRECT
            padded = -(-block_bytes // _PAGE) * _PAGE
            count = staging_pages * self.parts
            memory = np.zeros(count * padded + _PAGE, dtype=np.uint8)
            offset = -memory.ctypes.data % _PAGE
            self.rows = memory[offset : offset + count * padded].reshape(count, padded)[:, :block_bytes]
            self._staging = torch.from_numpy(self.rows)
            self._page_num = 0
            self.staged = True
            self._slots = staging_pages
            self._free = list(range(staging_pages))
        self.block_bytes = int(self.rows.shape[1])

    # -- in place --------------------------------------------------------------------------------

    def _in_place(self, pool: Any) -> tuple[np.ndarray, int, int] | None:
        """(rows, parts, page count) when every part of every page is a fixed-stride run of the
        pool's buffer, else None (the page is staged)."""
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is None or isinstance(buffer, (list, tuple)) or not buffer.is_contiguous():
            return None
        size = int(pool.size)
        if size % self.page_size:
            return None
        page_num = size // self.page_size
        try:
            first = pool.get_data_page(0, flat=False)
        except (ValueError, IndexError, NotImplementedError):
            return None
        nbytes = first.numel() * first.element_size()
        pieces = [first] if first.is_contiguous() else [first[i] for i in range(first.shape[0])]
        if len(pieces) > 2 or not all(piece.is_contiguous() for piece in pieces):
            return None
        part_bytes = nbytes // len(pieces)
        if any(piece.numel() * piece.element_size() != part_bytes for piece in pieces):
            return None
        base = _address(buffer)
        start = _address(pieces[0]) - base
        if page_num > 1:
            second = pool.get_data_page(self.page_size, flat=False)
            stride = _address(second if len(pieces) == 1 else second[0]) - _address(pieces[0])
        else:
            stride = part_bytes
        if stride < part_bytes:
            return None
        if len(pieces) == 2 and _address(pieces[1]) - _address(pieces[0]) != page_num * stride:
            return None  # the V half is not where the K rows continue: not one row array
        total = buffer.numel() * buffer.element_size()
        rows_num = page_num * len(pieces)
        if start < 0 or start + (rows_num - 1) * stride + part_bytes > total:
            return None
        memory = buffer.view(-1).view(_uint8()).numpy()
        rows = np.lib.stride_tricks.as_strided(
            memory[start:], shape=(rows_num, part_bytes), strides=(stride, 1), writeable=True
        )
        # the last page too: a layout whose stride changes part-way would fail here
        last = (page_num - 1) * self.page_size
        view = pool.get_data_page(last, flat=False)
        expect = [_address(view)] if len(pieces) == 1 else [_address(view[i]) for i in range(len(pieces))]
        got = [rows[c * page_num + page_num - 1].ctypes.data for c in range(len(pieces))]
        if expect != got:
            return None
        return rows, len(pieces), page_num

    def page_rows(self, start: int) -> list[int]:
        """The rows of the page starting at host slot ``start``, one per part (in place only)."""
        page = int(start) // self.page_size
        return [part * self._page_num + page for part in range(self.parts)]

    # -- staged ----------------------------------------------------------------------------------

    @property
    def staging_pages(self) -> int:
        """Pages the staging buffer holds at once (0 in place)."""
        return self._slots

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's flat form."""
        return self.block_bytes * self.parts

    def acquire(self, count: int) -> list[int]:
        """``count`` staging slots (at most the buffer's), waiting for ones in use to come back."""
        count = min(count, self._slots)
        with self._lock:
            while len(self._free) < count:
                self._lock.wait()
            taken, self._free = self._free[:count], self._free[count:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            self._lock.notify_all()

    def slot_rows(self, slot: int) -> list[int]:
        """The rows of staging slot ``slot``, one per part of the page it holds."""
        return [slot * self.parts + part for part in range(self.parts)]

    def put(self, slot: int, page: Any) -> None:
        """Copy ``page`` (a page in its flat form, any dtype) into staging slot ``slot``."""
        data = page.contiguous().view(-1).view(_uint8())
        for part, row in enumerate(self.slot_rows(slot)):
            self._staging[row].copy_(data[part * self.block_bytes : (part + 1) * self.block_bytes])

    def take(self, slot: int, target: Any) -> Any:
        """Copy staging slot ``slot`` into ``target`` (a contiguous flat page); ``target``."""
        data = target.view(-1).view(_uint8())
        for part, row in enumerate(self.slot_rows(slot)):
            data[part * self.block_bytes : (part + 1) * self.block_bytes].copy_(self._staging[row])
        return target

    def stage_out(self, start: int, slot: int) -> None:
        """Copy the page at host slot ``start`` into staging slot ``slot`` (before a store)."""
        self.put(slot, self.pool.get_data_page(int(start), flat=True))

    def stage_in(self, start: int, slot: int) -> None:
        """Copy staging slot ``slot`` into the page at host slot ``start`` (after a verified load)."""
        flat = self.pool.get_dummy_flat_data_page()
        page = self._staging[slot].view(flat.dtype) if self.parts == 1 else self.take(slot, flat)
        self.pool.set_from_flat_data_page(int(start), page)


def _uint8() -> Any:
    import torch

    return torch.uint8

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

Who uses it: :class:`~kvtier.integrations.sglang.storage.KvtierHiCacheStorage`, from SGLang's
storage threads; the staging rows are handed out under a lock.
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

    ``parts``: blocks per page (1 or 2); ``block_bytes``: bytes of one block;
    ``staged``: whether pages go through the staging buffer rather than in place.
    """

    def __init__(self, pool: Any, staging_pages: int):
        self.pool = pool
        self.page_size = int(pool.page_size)
        self._lock = threading.Condition()
        found = self._in_place(pool)
        if found is not None:
            self.rows, self.parts, self._page_num = found
            self.staged = False
            self._free: list[int] = []
        else:
            import torch

            flat = pool.get_dummy_flat_data_page()
            page_bytes = flat.numel() * flat.element_size()
            # rows on 4 KiB pages, 4 KiB apart: the tiers can then read and write them with O_DIRECT
            padded = -(-page_bytes // _PAGE) * _PAGE
            memory = np.zeros(staging_pages * padded + _PAGE, dtype=np.uint8)
            offset = -memory.ctypes.data % _PAGE
            self.rows = memory[offset : offset + staging_pages * padded].reshape(staging_pages, padded)[
                :, :page_bytes
            ]
            self._staging = torch.from_numpy(self.rows)
            self.parts, self._page_num = 1, 0
            self.staged = True
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

    # -- rows of pages ---------------------------------------------------------------------------

    def page_rows(self, start: int) -> list[int]:
        """The rows of the page starting at host slot ``start``, one per part (in place only)."""
        page = int(start) // self.page_size
        return [part * self._page_num + page for part in range(self.parts)]

    def acquire(self, count: int) -> list[int]:
        """``count`` staging rows (at most the buffer's), waiting for ones in use to come back."""
        count = min(count, len(self._staging))
        with self._lock:
            while len(self._free) < count:
                self._lock.wait()
            taken, self._free = self._free[:count], self._free[count:]
        return taken

    def release(self, rows: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(rows)
            self._lock.notify_all()

    @property
    def staging_pages(self) -> int:
        return len(self._staging) if self.staged else 0

    def stage_out(self, start: int, row: int) -> None:
        """Copy the page at host slot ``start`` into staging row ``row`` (before a store)."""
        page = self.pool.get_data_page(int(start), flat=True)
        self._staging[row].copy_(page.contiguous().view(-1).view(_uint8()))

    def stage_in(self, start: int, row: int) -> None:
        """Copy staging row ``row`` into the page at host slot ``start`` (after a verified load)."""
        flat = self.pool.get_dummy_flat_data_page()
        self.pool.set_from_flat_data_page(int(start), self._staging[row].view(flat.dtype))


def _uint8() -> Any:
    import torch

    return torch.uint8

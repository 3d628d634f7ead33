"""Finding the blocks of a store directory by their headers alone, without its index.

The block format puts a header page in front of every block, at a multiple of the on-disk
block size in whichever file holds it (the ``lmdb`` kind's slab, the ``files`` kind's one
file per block), so a scan of the directory finds the blocks of both kinds. Fault tooling
uses it to reach a block's bytes from outside the tier (``kvtier soak`` damaging blocks under
a running tier, tests doing the same). A freed ``lmdb`` slot keeps its old header until it
is reused, so a key may be found more than once: the live copy and stale ones.

Who calls it: tools and tests, any thread; it reads every header page under ``path``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from kvtier.tiers.disk.format import HEADER_BYTES, decode_header, on_disk_block_bytes

__all__ = ["find_blocks"]


def find_blocks(path: str, block_bytes: int) -> Iterator[tuple[str, int, bytes]]:
    """Every block header under the store directory ``path`` whose payload is ``block_bytes``
    long: ``(file, offset of the header, key)``, in directory-walk order."""
    slot = on_disk_block_bytes(block_bytes)
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            info = os.lstat(file)
            if not stat.S_ISREG(info.st_mode):  # a symlink or FIFO is no block (and a FIFO would hang)
                continue
            size = info.st_size
            with open(file, "rb") as stream:
                for offset in range(0, size - HEADER_BYTES + 1, slot):
                    stream.seek(offset)
                    header = decode_header(stream.read(HEADER_BYTES))
                    if not isinstance(header, str) and header.payload_bytes == block_bytes:
                        yield file, offset, header.key

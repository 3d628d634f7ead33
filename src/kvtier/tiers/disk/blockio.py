"""Block I/O of the disk tiers: one block = one ``pwritev``/``preadv`` of ``[header page, CPU row]``.

Here: page-aligned buffers, the O_DIRECT probe (once per directory, cached), :class:`RowIO`
(CPU rows as I/O vectors, padded for O_DIRECT where the rows allow it), and :class:`BlockIO`,
which writes and reads (and verifies) one block and owns the tier's O_DIRECT state: its
:meth:`BlockIO.with_fallback` is the one place where an O_DIRECT call that fails with EINVAL
is retried buffered, and O_DIRECT switched off for the tier (logged and counted once).

With a codec (:mod:`kvtier.codecs`) a block moves through a per-thread page-aligned buffer
instead of straight from and into the row: encoded from the row into it and written from it;
read into it, verified there (checksum or MAC over the stored bytes), and only then decoded
into the row.

Who calls it: the mover's I/O threads (every method is thread-safe and blocks only in its
own system calls), and ``check()`` on the caller's thread.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvtier.base import OffloadKey
from kvtier.codecs import BlockCodec, CodecError
from kvtier.tiers.indexed import TierCounters
from kvtier.tiers.jobs import Failure
from kvtier.tiers.disk.format import (
    HEADER_BYTES,
    NO_CODEC,
    PAGE_BYTES,
    decode_header,
    padded_payload_bytes,
    verify,
)
from kvtier.tiers.secret import TierKeys, encode_block_header

__all__ = [
    "O_DIRECT",
    "BlockIO",
    "ODirectProbe",
    "RowIO",
    "aligned_buffer",
    "probe_o_direct",
    "scratch_page",
]

logger = logging.getLogger(__name__)

#: ``os.O_DIRECT`` where the platform has it, else 0
O_DIRECT = getattr(os, "O_DIRECT", 0)

T = TypeVar("T")


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to pages) of zeroed, page-aligned memory: an O_DIRECT buffer.

    An anonymous mapping always starts on a page boundary, which a ``bytearray`` does not.
    """
    return mmap.mmap(-1, max(PAGE_BYTES, padded_payload_bytes(nbytes)))


_thread_pages = threading.local()


def scratch_page() -> mmap.mmap:
    """This thread's own page-aligned 4096-byte buffer (for block headers); made once per thread."""
    page = getattr(_thread_pages, "page", None)
    if page is None:
        page = _thread_pages.page = aligned_buffer(PAGE_BYTES)
    return page


# ---------------------------------------------------------------------------------------------
# O_DIRECT


@dataclass(frozen=True)
class ODirectProbe:
    """Whether O_DIRECT works in a directory, and why not when it does not."""

    supported: bool
    reason: str = ""


_probe_lock = threading.Lock()
_probes: dict[str, ODirectProbe] = {}


def probe_o_direct(directory: str) -> ODirectProbe:
    """Whether an aligned O_DIRECT write and read-back work in ``directory`` (cached per directory).

    Some filesystems refuse O_DIRECT at open (tmpfs before Linux 6.6, overlayfs in some
    containers) and some at the first write (EINVAL); only a real write and read tells. Blocks
    for a few small I/Os the first time for a directory, never afterwards.
    """
    key = os.path.realpath(directory)
    with _probe_lock:
        found = _probes.get(key)
        if found is None:
            found = _probes[key] = _probe(key)
    return found


def _probe(directory: str) -> ODirectProbe:
    if not O_DIRECT:
        return ODirectProbe(False, "this platform has no O_DIRECT")
    path = os.path.join(directory, f".kvtier-odirect-probe-{os.getpid()}-{secrets.token_hex(4)}")
    out = aligned_buffer(PAGE_BYTES)
    back = aligned_buffer(PAGE_BYTES)
    out[:16] = b"kvtier o_direct!"
    step = "open"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            step = "write"
            if os.pwrite(fd, out, 0) != PAGE_BYTES:
                return ODirectProbe(False, "short O_DIRECT write")
            step = "read"
            if os.preadv(fd, [back], 0) != PAGE_BYTES or back[:] != out[:]:
                return ODirectProbe(False, "O_DIRECT read-back differs from what was written")
        finally:
            os.close(fd)
        return ODirectProbe(True)
    except OSError as exc:
        return ODirectProbe(
            False, f"O_DIRECT {step} fails here: {exc.strerror} ({Failure.from_exception(exc)})"
        )
    finally:
        out.close()
        back.close()
        try:
            os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# CPU rows as I/O vectors


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    try:
        from numpy.lib.array_utils import byte_bounds  # numpy >= 2
    except ImportError:  # numpy 1.x
        byte_bounds = np.byte_bounds  # type: ignore[attr-defined]
    return byte_bounds(array)


class RowIO:
    """The CPU tier's rows as buffers for ``pwritev``/``preadv``; any thread, never blocks.

    With O_DIRECT every buffer address and length must be a multiple of 4096. The CPU tier's
    rows start on pages and are ``row_stride`` (``block_bytes`` rounded up to 4096) apart, and
    the padding after a row's ``block_bytes`` belongs to that row alone, so a row's *padded*
    span is a valid O_DIRECT buffer: a store writes the padding along (a few junk bytes on
    disk, outside the checksum) and a load overwrites it. This relies on the padding of every
    row (the last one included) lying inside the array's memory, which :meth:`direct_problem`
    checks; rows that fail the check get buffered I/O of exactly ``block_bytes``, still straight
    into the row (no staging copy).
    """

    def __init__(self, rows: np.ndarray):
        if rows.ndim != 2 or rows.dtype != np.uint8 or rows.strides[1] != 1:
            raise ValueError(
                f"rows must be a (num_rows, block_bytes) uint8 array with contiguous rows, "
                f"got shape {rows.shape}, dtype {rows.dtype}, strides {rows.strides}"
            )
        self.rows = rows
        self.num_rows, self.block_bytes = rows.shape
        #: bytes an O_DIRECT transfer of one row moves
        self.padded_bytes = padded_payload_bytes(self.block_bytes)
        #: why the rows cannot be O_DIRECT buffers, or None when they can
        self.direct_problem = self._direct_problem()
        self._padded = rows
        if self.direct_problem is None and self.padded_bytes != self.block_bytes:
            self._padded = np.lib.stride_tricks.as_strided(
                rows, shape=(self.num_rows, self.padded_bytes), strides=rows.strides
            )

    def _direct_problem(self) -> str | None:
        address = self.rows.__array_interface__["data"][0]
        stride = self.rows.strides[0]
        if address % PAGE_BYTES:
            return "the CPU rows do not start on a 4096-byte page"
        if self.num_rows > 1 and (stride % PAGE_BYTES or stride < self.padded_bytes):
            return f"the CPU row stride ({stride} bytes) is not a multiple of 4096 covering a row"
        root = self.rows
        while isinstance(root.base, np.ndarray):
            root = root.base
        _, high = _byte_bounds(root)
        if address + (self.num_rows - 1) * stride + self.padded_bytes > high:
            return "the last CPU row has no padding up to a multiple of 4096 bytes"
        if not self.rows.flags.writeable:
            return "the CPU rows are read-only"
        return None

    def payload(self, row: int) -> np.ndarray:
        """Row ``row``'s ``block_bytes`` (what is checksummed)."""
        return self.rows[row]

    def iov(self, row: int, direct: bool) -> np.ndarray:
        """Row ``row`` as an I/O buffer: its padded span for O_DIRECT, else ``block_bytes``."""
        return self._padded[row] if direct else self.rows[row]

    def io_bytes(self, direct: bool) -> int:
        """Length of :meth:`iov`."""
        return self.padded_bytes if direct else self.block_bytes


# ---------------------------------------------------------------------------------------------
# One block


class BlockIO:
    """Writes, reads and verifies one block at a time for one tier; any thread.

    ``direct`` is whether O_DIRECT is in use now; it only ever goes from True to False (see
    :meth:`with_fallback`). ``counters`` get ``o_direct_fallbacks`` (and with a codec
    ``codec_block_bytes`` and ``codec_stored_bytes``, what the blocks written held and took);
    ``where`` names the tier in log lines.
    """

    def __init__(
        self,
        rowio: RowIO,
        layout_digest: bytes,
        direct: bool,
        counters: TierCounters,
        where: str,
        keys: TierKeys | None = None,
        codec: BlockCodec | None = None,
    ):
        self.rowio = rowio
        #: the tier's secret keys (keyed MAC, encryption), or None for xxh3 checksums only
        self.keys = keys
        #: the tier's codec, or None: blocks stored as they are
        self.codec = codec
        self._descriptor = codec.descriptor if codec is not None else NO_CODEC
        #: the most payload bytes one block takes on the medium
        self.payload_bytes = codec.max_encoded_bytes if codec is not None else rowio.block_bytes
        self._cipher_pages = threading.local()  # per thread: an encrypted payload on its way out
        self._codec_pages = threading.local()  # per thread: an encoded payload on its way in or out
        self.block_bytes = rowio.block_bytes
        self.direct = direct
        #: why O_DIRECT is not used (empty while it is, or when it was never asked for)
        self.fallback_reason = ""
        self._digest = layout_digest
        self._counters = counters
        self._where = where

    def fall_back(self, reason: str) -> None:
        """Stop using O_DIRECT (any thread): logged once, counted once."""
        with self._counters.lock:
            self.direct = False
            if self.fallback_reason:
                return  # another thread fell back first
            self.fallback_reason = reason
        self._counters.add("o_direct_fallbacks")
        logger.warning(
            "kvtier %s: O_DIRECT not used (%s); falling back to buffered I/O, which costs "
            "page-cache copies and memory",
            self._where,
            reason,
        )

    def with_fallback(self, what: str, operation: Callable[[bool], T]) -> T:
        """``operation(direct)``; if an O_DIRECT attempt fails with EINVAL, fall back and
        retry it buffered. ``operation`` must leave nothing behind when it raises (a
        half-written temp file). Raises the OSError of the attempt that counts.

        Why EINVAL: a filesystem may accept O_DIRECT at open and the probe's aligned page,
        and still refuse an I/O (some FUSE and network filesystems), and only then says so.
        """
        direct = self.direct
        try:
            return operation(direct)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            self.fall_back(f"an O_DIRECT {what} failed: {exc.strerror}")
        return operation(False)

    def write(self, fd: int, offset: int, key: OffloadKey, row: int, direct: bool) -> int:
        """Write ``key``'s block from CPU row ``row`` at ``offset`` of ``fd``: header page + row.

        One ``pwritev`` straight from the row (no staging copy); the payload bytes stored
        (encoded, with a codec). Raises ``OSError``; a short write on a regular file means the
        filesystem ran out of room, reported as ENOSPC.
        """
        page = scratch_page()
        stored = self.block_bytes
        if self.codec is not None:
            iov, stored = self._encoded(page, key, row, direct)
        else:
            rowio = self.rowio
            encode_block_header(
                page,
                layout_digest=self._digest,
                key=key,
                payload=rowio.payload(row),
                payload_bytes=self.block_bytes,
                keys=self.keys,
            )
            iov = rowio.iov(row, direct) if self.keys is None else self._sealed(page, row, direct)
        expected = HEADER_BYTES + len(iov)
        written = os.pwritev(fd, [page, iov], offset)  # type: ignore[list-item]  # numpy stubs: Buffer on 3.12+
        if written != expected:
            raise OSError(errno.ENOSPC, f"short write: {written} of {expected} bytes")
        return stored

    def _sealed(self, page, row: int, direct: bool):
        """Tag the block (header in ``page``) and return its payload as an I/O buffer: the
        row itself, or, encrypting, this thread's page-aligned ciphertext buffer (the row is
        the CPU tier's live copy and must stay plaintext)."""
        rowio = self.rowio
        keys = self.keys
        assert keys is not None  # write() calls this only for a keyed tier
        if not keys.encrypt:
            keys.seal(page, rowio.payload(row))
            return rowio.iov(row, direct)
        out = self._thread_buffer(self._cipher_pages)
        keys.seal(page, rowio.payload(row), out[: self.block_bytes])
        return out[: rowio.io_bytes(direct)]

    def _thread_buffer(self, local: threading.local) -> np.ndarray:
        """This thread's page-aligned buffer of ``local`` (made once per thread): room for a
        row or an encoded block, padded for O_DIRECT."""
        out = getattr(local, "page", None)
        if out is None:
            size = max(self.rowio.padded_bytes, padded_payload_bytes(self.payload_bytes))
            out = local.page = np.frombuffer(aligned_buffer(size), dtype=np.uint8)
        return out

    def _encoded(self, page, key: OffloadKey, row: int, direct: bool) -> tuple[np.ndarray, int]:
        """Encode row ``row`` into this thread's codec buffer, write its header (over the
        encoded bytes) into ``page`` and seal it; the payload as an I/O buffer, and its bytes."""
        codec = self.codec
        assert codec is not None  # write() calls this only with a codec
        out = self._thread_buffer(self._codec_pages)
        size = codec.encode_into(self.rowio.payload(row), out)
        encoded = out[:size]
        keys = self.keys
        encode_block_header(
            page,
            layout_digest=self._digest,
            key=key,
            payload=encoded,
            payload_bytes=size,
            keys=keys,
            codec=self._descriptor,
        )
        if keys is not None:
            if keys.encrypt:
                out = self._thread_buffer(self._cipher_pages)
                keys.seal(page, encoded, out[:size])
            else:
                keys.seal(page, encoded)
        self._counters.add("codec_block_bytes", self.block_bytes)
        self._counters.add("codec_stored_bytes", size)
        return out[: padded_payload_bytes(size) if direct else size], size

    def read(self, fd: int, offset: int, key: OffloadKey, row: int, direct: bool) -> Failure | None:
        """Read the block at ``offset`` of ``fd`` straight into CPU row ``row`` and verify it there.

        Returns ``None`` if the row now holds ``key``'s block, else why not. Raises ``OSError``.
        """
        page = scratch_page()
        rowio = self.rowio
        if self.codec is not None:
            buffer = self._thread_buffer(self._codec_pages)
            iov = buffer[: padded_payload_bytes(self.payload_bytes) if direct else self.payload_bytes]
            nread = os.preadv(fd, [page, iov], offset)  # type: ignore[list-item]  # numpy stubs: Buffer on 3.12+
            problem = self._verify(page, buffer, nread, key)
            if problem is None:
                problem = self._decode(page, buffer, rowio.payload(row))
            return None if problem is None else Failure.corrupt(problem)
        nread = os.preadv(fd, [page, rowio.iov(row, direct)], offset)  # type: ignore[list-item]  # numpy stubs: Buffer on 3.12+
        problem = self._verify(page, rowio.payload(row), nread, key)
        return None if problem is None else Failure.corrupt(problem)

    def _verify(self, page, payload: np.ndarray, nread: int, key: OffloadKey) -> str | None:
        """:func:`~kvtier.tiers.disk.format.verify` as this tier reads (layout, codec, secret)."""
        codec = self.codec
        return verify(
            page,
            payload,
            nread,
            key=key,
            layout_digest=self._digest,
            payload_bytes=self.payload_bytes,
            keys=self.keys,
            codec=self._descriptor,
            exact=codec is None or codec.fixed_size,
        )

    def _decode(self, page, stored: np.ndarray, row: np.ndarray) -> str | None:
        """Decode a verified block's payload (header in ``page``) into ``row``; ``None``, or
        ``codec`` when the codec refuses it (written by a kvtier with another codec bug, or
        forged past an unkeyed checksum): a corrupt block, never served."""
        codec = self.codec
        assert codec is not None
        header = decode_header(page)
        assert not isinstance(header, str)  # verified just before
        try:
            codec.decode_into(stored[: header.payload_bytes], row)
        except CodecError:
            return "codec"
        return None

    def check_buffers(self) -> tuple[mmap.mmap, np.ndarray]:
        """A private header page and payload buffer for :meth:`read_for_check` (sized for the
        current mode: padded for O_DIRECT, ``block_bytes`` otherwise)."""
        page = aligned_buffer(HEADER_BYTES)
        padded = padded_payload_bytes(self.payload_bytes)
        payload = np.frombuffer(aligned_buffer(padded), dtype=np.uint8)
        return page, payload if self.direct else payload[: self.payload_bytes]

    def read_for_check(self, fd: int, offset: int, key: OffloadKey, page, payload: np.ndarray) -> str | None:
        """Read and verify one block into check buffers (caller's thread); the problem or None."""
        try:
            nread = os.preadv(fd, [page, payload], offset)  # type: ignore[list-item]  # numpy stubs: Buffer on 3.12+
        except OSError as exc:
            return str(Failure.from_exception(exc))
        return self._verify(page, payload[: self.payload_bytes], nread, key)

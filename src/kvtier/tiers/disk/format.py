"""The on-disk block format shared by the disk tiers: layout fingerprint, block header, checks.

Every block a disk tier writes is one 4096-byte header page followed by the payload::

    offset 0     header: magic, format version, layout digest, payload length, payload
                 xxh3-64, key length, key, then an xxh3-64 of the header bytes before it
    offset 4096  payload: ``block_bytes`` bytes (one CPU-tier row), padded with whatever the
                 row's padding held up to a multiple of 4096 when written with O_DIRECT

Why a whole page for ~100 bytes of header: O_DIRECT needs 4096-aligned offsets and lengths,
and a page in front keeps the payload aligned, so one ``pwritev``/``preadv`` of
``[header page, CPU row]`` moves a block with no staging copy. The page costs 0.2% of a 2 MiB
block. (Rejected: a header after the payload — same cost, but a truncated block would then lose
its header first and read as "bad magic" instead of "truncated".)

Reading a block never trusts anything on disk: :func:`verify` checks the header's own checksum,
the magic and version, the layout digest, the key and the payload length and checksum, and
returns the reason for the first mismatch. A block that fails is a miss, never served.

Who calls what: the disk tiers' I/O threads encode and verify (every function here is pure and
thread-safe); :class:`LayoutFingerprint` is built once by whoever opens a tier.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, fields

import numpy as np
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "PAGE_BYTES",
    "BlockHeader",
    "LayoutFingerprint",
    "decode_header",
    "encode_header_into",
    "on_disk_block_bytes",
    "padded_payload_bytes",
    "verify",
]

#: the version of this block layout; a reader refuses blocks of any other version
FORMAT_VERSION = 1
#: bytes of the header page in front of every payload
HEADER_BYTES = 4096
#: O_DIRECT alignment (offsets, lengths and buffer addresses) this format keeps
PAGE_BYTES = 4096
#: the longest key a header holds (vLLM keys are 12 to 36 bytes)
MAX_KEY_BYTES = 1024

_MAGIC = b"KVTBLOCK"
# magic, format version, reserved (0), flags (0), layout digest, payload length,
# payload xxh3-64, key length; then the key, then the header's own xxh3-64
_FIXED = struct.Struct("<8sHHI16sQQH")
_HEADER_SUM = struct.Struct("<Q")
assert _FIXED.size + MAX_KEY_BYTES + _HEADER_SUM.size <= HEADER_BYTES
_ZEROS = bytes(HEADER_BYTES)


def padded_payload_bytes(block_bytes: int) -> int:
    """``block_bytes`` rounded up to whole pages: what an O_DIRECT transfer of a row moves."""
    return -(-block_bytes // PAGE_BYTES) * PAGE_BYTES


def on_disk_block_bytes(block_bytes: int) -> int:
    """Bytes one block takes on disk (header page + padded payload); capacity is counted in these."""
    return HEADER_BYTES + padded_payload_bytes(block_bytes)


@dataclass(frozen=True)
class LayoutFingerprint:
    """What makes a block's bytes meaningful: the same key under another layout is other data.

    Stored (as :meth:`digest`) in every block header and (as fields) in the store's manifest.
    A tier opened with a different fingerprint serves nothing of the old data.
    """

    #: model name or path the KV cache belongs to
    model: str
    #: KV-cache dtype (``"bfloat16"``, ``"fp8_e4m3"`` ...)
    dtype: str
    #: tokens one offloaded block spans
    tokens_per_block: int
    #: bytes of one GPU page per KV group, in group order
    page_bytes: tuple[int, ...]
    #: tensor-parallel rank whose shard the block holds (0 when a block holds every rank's)
    rank: int
    #: tensor-parallel world size
    world_size: int
    #: payload bytes of one block (one CPU-tier row)
    block_bytes: int

    def __post_init__(self) -> None:
        # Lists arrive from JSON and from engine code; a tuple keeps the dataclass hashable.
        object.__setattr__(self, "page_bytes", tuple(int(p) for p in self.page_bytes))
        for name in ("tokens_per_block", "rank", "world_size", "block_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LayoutFingerprint.{name} must be an int >= 0, got {value!r}")
        if self.block_bytes < 1 or self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"LayoutFingerprint needs block_bytes >= 1 and 0 <= rank < world_size, got "
                f"block_bytes={self.block_bytes}, rank={self.rank}, world_size={self.world_size}"
            )

    @classmethod
    def standalone(cls, block_bytes: int) -> LayoutFingerprint:
        """The fingerprint kvtier uses when it runs without an engine (CLI, benchmarks, tests)."""
        return cls(
            model="standalone",
            dtype="uint8",
            tokens_per_block=0,
            page_bytes=(block_bytes,),
            rank=0,
            world_size=1,
            block_bytes=block_bytes,
        )

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (the manifest's ``fingerprint``)."""
        record = asdict(self)
        record["page_bytes"] = list(self.page_bytes)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> LayoutFingerprint:
        """Inverse of :meth:`to_dict`; raises ``ValueError``/``TypeError``/``KeyError`` if malformed."""
        return cls(**{f.name: record[f.name] for f in fields(cls)})

    def digest(self) -> bytes:
        """16 bytes naming this layout: xxh3-128 of a canonical JSON encoding.

        A checksum, not a cryptographic hash: it guards against mix-ups, not against an
        attacker who can write the store's directory (who could write any bytes anyway).
        """
        canonical = json.dumps(
            {"kvtier_layout": 1, **self.to_dict()}, sort_keys=True, separators=(",", ":")
        )
        return xxhash.xxh3_128_digest(canonical.encode())

    def describe(self) -> str:
        """One line of the main fields, for logs and errors."""
        return (
            f"model={self.model} dtype={self.dtype} tokens_per_block={self.tokens_per_block} "
            f"page_bytes={list(self.page_bytes)} rank={self.rank}/{self.world_size} "
            f"block_bytes={self.block_bytes}"
        )


@dataclass(frozen=True)
class BlockHeader:
    """A decoded header (see :func:`decode_header`)."""

    version: int
    layout_digest: bytes
    payload_bytes: int
    checksum: int
    key: bytes


def encode_header_into(
    buffer, *, layout_digest: bytes, key: bytes, payload_bytes: int, checksum: int
) -> None:
    """Write the header of a block into the first :data:`HEADER_BYTES` of ``buffer``.

    ``buffer`` is writable (a per-thread page-aligned scratch page); the bytes after the
    header are zeroed so that a block's header page is the same whatever the buffer held.
    """
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    view = memoryview(buffer)
    _FIXED.pack_into(
        view, 0, _MAGIC, FORMAT_VERSION, 0, 0, layout_digest, payload_bytes, checksum, len(key)
    )
    end = _FIXED.size + len(key)
    view[_FIXED.size : end] = key
    _HEADER_SUM.pack_into(view, end, xxhash.xxh3_64_intdigest(view[:end]))
    tail = end + _HEADER_SUM.size
    view[tail:HEADER_BYTES] = _ZEROS[tail:]


def decode_header(buffer) -> BlockHeader | str:
    """The header in ``buffer``'s first page, or the reason it is not a valid header."""
    view = memoryview(buffer)
    if len(view) < HEADER_BYTES:
        return "truncated"
    magic, version, _reserved, _flags, digest, payload_bytes, checksum, key_len = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != _MAGIC:
        return "bad magic"
    if version != FORMAT_VERSION:
        return f"format version {version}"
    if key_len > MAX_KEY_BYTES:
        return "header checksum"  # a length this large can only be damage
    end = _FIXED.size + key_len
    (stored_sum,) = _HEADER_SUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_sum:
        return "header checksum"
    return BlockHeader(version, digest, payload_bytes, checksum, bytes(view[_FIXED.size : end]))


def verify(
    header_page,
    payload: np.ndarray | memoryview,
    nread: int,
    *,
    key: bytes,
    layout_digest: bytes,
    payload_bytes: int,
) -> str | None:
    """Why the block just read is not ``key``'s block of this layout, or ``None`` if it is.

    ``nread`` is how many bytes the read returned (header page + payload); ``payload`` is
    where the payload landed (the CPU row), exactly ``payload_bytes`` long. The checks run
    cheapest first; the payload checksum (xxh3-64, ~15 GB/s) runs only when all else holds.
    Reasons: ``truncated``, ``bad magic``, ``format version N``, ``header checksum``,
    ``other layout``, ``other key``, ``payload length``, ``checksum``.
    """
    if nread < HEADER_BYTES:
        return "truncated"
    header = decode_header(header_page)
    if isinstance(header, str):
        return header
    if header.layout_digest != layout_digest:
        return "other layout"
    if header.key != key:
        return "other key"
    if header.payload_bytes != payload_bytes:
        return "payload length"
    if nread < HEADER_BYTES + payload_bytes:
        return "truncated"
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        return "checksum"
    return None

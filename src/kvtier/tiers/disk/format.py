"""The on-disk block format shared by the disk tiers: layout fingerprint, block header, checks.

Every block a disk tier writes is one 4096-byte header page followed by the payload::

    offset 0     header: magic, format version, flags, layout digest, payload length, payload
                 xxh3-64, salt, tag, key length, key, then an xxh3-64 of the header bytes
                 before it
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

Version 2 (this one) adds ``flags``, ``salt`` and ``tag`` for tiers with a secret
(:mod:`kvtier.tiers.secret`): a *keyed* block carries a MAC (``tag``, over the header and the
payload, under a key derived from the secret and the block's random ``salt``) instead of the
xxh3 payload checksum, and an *encrypted* one holds its payload as AES-GCM ciphertext. A tier
with a secret serves only keyed blocks whose tag holds; a tier without one serves only
unkeyed blocks. Version 1 blocks (no flags, salt or tag) are still read, as unkeyed blocks.

Version 3 adds a block codec's descriptor (:mod:`kvtier.codecs`: its name and parameters)
between the tag and the key length; the payload is then the encoded block, ``payload length``
bytes (at most ``block_bytes``), and its checksum or MAC covers what is stored, so a block is
verified before anything decodes it. Blocks stored without a codec are still written as
version 2, which every reader since then reads. A reader decodes only blocks whose descriptor
is its own codec's: any other is ``other codec``, never decoded.

Who calls what: the disk tiers' I/O threads encode and verify (every function here is pure and
thread-safe); :class:`LayoutFingerprint` is built once by whoever opens a tier.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import xxhash

__all__ = [
    "CODEC_BYTES",
    "FLAG_ENCRYPTED",
    "FLAG_KEYED",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "NO_CODEC",
    "PAGE_BYTES",
    "READ_VERSIONS",
    "SALT_BYTES",
    "TAG_BYTES",
    "BlockHeader",
    "LayoutFingerprint",
    "decode_header",
    "differing_part",
    "encode_header_into",
    "header_flags",
    "mac_parts",
    "on_disk_block_bytes",
    "padded_payload_bytes",
    "set_tag",
    "verify",
]

#: the newest version of the block layout written (version 2 where a block has no codec);
#: a reader refuses blocks not in READ_VERSIONS
FORMAT_VERSION = 3
#: versions read: 1 (before flags, salt and tag) is read as an unkeyed block, 2 as a block
#: without a codec
READ_VERSIONS = (1, 2, 3)
#: bytes of the header page in front of every payload
HEADER_BYTES = 4096
#: O_DIRECT alignment (offsets, lengths and buffer addresses) this format keeps
PAGE_BYTES = 4096
#: the longest key a header holds (vLLM keys are 12 to 36 bytes)
MAX_KEY_BYTES = 1024

#: ``flags``: the block carries a keyed MAC in ``tag`` (no xxh3 payload checksum)
FLAG_KEYED = 1
#: ``flags``: the payload is AES-GCM ciphertext (always with FLAG_KEYED; ``tag`` is GCM's)
FLAG_ENCRYPTED = 2
#: bytes of a block's random salt (the per-block key is derived from the secret and it)
SALT_BYTES = 16
#: bytes of a keyed block's tag
TAG_BYTES = 16
#: bytes of a codec's descriptor in a version-3 header (:attr:`kvtier.codecs.BlockCodec.descriptor`)
CODEC_BYTES = 16
#: the descriptor of a block stored as it is, without a codec
NO_CODEC = bytes(CODEC_BYTES)

_MAGIC = b"KVTBLOCK"
# version 1: magic, format version, reserved (0), flags (0), layout digest, payload length,
# payload xxh3-64, key length; then the key, then the header's own xxh3-64
_FIXED_V1 = struct.Struct("<8sHHI16sQQH")
# version 2: the same, with salt and tag between the payload checksum and the key length
_FIXED = struct.Struct("<8sHHI16sQQ16s16sH")
_TAG_AT = _FIXED.size - 2 - TAG_BYTES
# version 3: the same, with the codec's descriptor between the tag and the key length
_FIXED_V3 = struct.Struct("<8sHHI16sQQ16s16s16sH")
_FIXED_SIZE = {2: _FIXED.size, 3: _FIXED_V3.size}
_HEADER_SUM = struct.Struct("<Q")
assert _FIXED_V3.size + MAX_KEY_BYTES + _HEADER_SUM.size <= HEADER_BYTES
_ZEROS = bytes(HEADER_BYTES)
_NO_SALT = bytes(SALT_BYTES)
_NO_TAG = bytes(TAG_BYTES)


def padded_payload_bytes(block_bytes: int) -> int:
    """``block_bytes`` rounded up to whole pages: what an O_DIRECT transfer of a row moves."""
    return -(-block_bytes // PAGE_BYTES) * PAGE_BYTES


def on_disk_block_bytes(block_bytes: int) -> int:
    """Bytes one block takes on disk (header page + padded payload); capacity is counted in these."""
    return HEADER_BYTES + padded_payload_bytes(block_bytes)


#: fields of a layout whose difference is a tensor-parallel mismatch
_TP_FIELDS = ("rank", "world_size")
#: facts of the parallel layout the engine integrations put in the ``model`` string
#: (vLLM: tp, pp, pcp, dcp, shards, replicated; SGLang: tp, pp, cp, replicated)
_PARALLEL_FACTS = frozenset({"tp", "pp", "pcp", "dcp", "cp", "shards", "replicated"})
#: what follows from the parallel layout: a shard's sizes (fields, and SGLang's per-rank
#: pool geometry in the ``model`` string), which change with it
_SHARD_FIELDS = frozenset({"page_bytes", "block_bytes", *_TP_FIELDS})
_SHARD_FACTS = frozenset({"head_num", "layer_num", "size_per_token"})


def _model_facts(model: object) -> tuple[list[str], dict[str, str]]:
    """A ``model`` string's plain parts and its ``name=value`` facts (split at ``|`` and ``;``)."""
    plain: list[str] = []
    facts: dict[str, str] = {}
    for part in str(model).replace("|", ";").split(";"):
        name, equals, value = part.partition("=")
        if equals:
            facts[name] = value
        else:
            plain.append(part)
    return plain, facts


def differing_part(own: Mapping[str, object], other: Mapping[str, object]) -> str:
    """Which part of a block's identity two layouts (:meth:`LayoutFingerprint.to_dict`)
    disagree on: ``tp`` (the parallel layout: rank or world size alone, or the tp/pp/cp facts
    engines put in ``model`` with the shard sizes that follow from them), ``layout`` (model,
    dtype, tokens per block, page or block bytes), ``codec`` (the codec blocks are stored with,
    alone), or ``namespace`` (none: the same layout, so what differs is where the blocks were
    put)."""
    differ = {name for name in set(own) | set(other) if own.get(name) != other.get(name)}
    if not differ:
        return "namespace"
    if differ == {"codec"}:
        return "codec"
    if differ <= set(_TP_FIELDS):
        return "tp"
    if not differ <= _SHARD_FIELDS | {"model"}:
        return "layout"  # dtype or tokens per block
    (own_plain, own_facts), (other_plain, other_facts) = (
        _model_facts(own.get("model")),
        _model_facts(other.get("model")),
    )
    names = set(own_facts) | set(other_facts)
    parallel = any(own_facts.get(n) != other_facts.get(n) for n in names & _PARALLEL_FACTS)
    rest = names - _PARALLEL_FACTS - _SHARD_FACTS
    same_rest = own_plain == other_plain and all(own_facts.get(n) == other_facts.get(n) for n in rest)
    return "tp" if parallel and same_rest else "layout"


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
    #: the codec a tier stores blocks with (``none``: as they are); a tier sets its own with
    #: :meth:`with_codec`, so that stores and namespaces of another codec are other layouts
    codec: str = "none"

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
    def standalone(cls, block_bytes: int, dtype: str = "uint8") -> LayoutFingerprint:
        """The fingerprint kvtier uses when it runs without an engine (CLI, benchmarks, tests);
        ``dtype``: the KV bytes' element dtype, when known (lossy codecs need it)."""
        return cls(
            model="standalone",
            dtype=dtype,
            tokens_per_block=0,
            page_bytes=(block_bytes,),
            rank=0,
            world_size=1,
            block_bytes=block_bytes,
        )

    def with_codec(self, codec: str) -> LayoutFingerprint:
        """This layout as a tier storing blocks with ``codec`` keeps it."""
        return replace(self, codec=codec)

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (the manifest's ``fingerprint``); ``codec`` only
        when there is one, so layouts without a codec keep the digest they always had."""
        record = asdict(self)
        record["page_bytes"] = list(self.page_bytes)
        if self.codec == "none":
            del record["codec"]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> LayoutFingerprint:
        """Inverse of :meth:`to_dict`; raises ``ValueError``/``TypeError``/``KeyError`` if malformed."""
        return cls(
            **{f.name: record[f.name] for f in fields(cls) if f.name != "codec"},
            codec=record.get("codec", "none"),
        )

    def digest(self) -> bytes:
        """16 bytes naming this layout: xxh3-128 of a canonical JSON encoding.

        A checksum, not a cryptographic hash: it guards against mix-ups, not against an
        attacker who can write the store's directory (who could write any bytes anyway).
        """
        canonical = json.dumps({"kvtier_layout": 1, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(canonical.encode())

    def describe(self) -> str:
        """One line of the main fields, for logs and errors."""
        return (
            f"model={self.model} dtype={self.dtype} tokens_per_block={self.tokens_per_block} "
            f"page_bytes={list(self.page_bytes)} rank={self.rank}/{self.world_size} "
            f"block_bytes={self.block_bytes}" + (f" codec={self.codec}" if self.codec != "none" else "")
        )


@dataclass(frozen=True)
class BlockHeader:
    """A decoded header (see :func:`decode_header`)."""

    version: int
    layout_digest: bytes
    payload_bytes: int
    #: xxh3-64 of the payload (0 in a keyed block)
    checksum: int
    key: bytes
    #: FLAG_KEYED, FLAG_ENCRYPTED (0 in version 1)
    flags: int = 0
    #: random per block, from which a keyed block's key is derived (zeros when unkeyed)
    salt: bytes = _NO_SALT
    #: a keyed block's MAC or GCM tag (zeros when unkeyed)
    tag: bytes = _NO_TAG
    #: a keyed block's 16-bit id of the secret that wrote it (0: unkeyed, or written before
    #: key ids), so a block under another secret is told from a damaged one
    key_id: int = 0
    #: the descriptor of the codec the payload is encoded with (:data:`NO_CODEC`: none)
    codec: bytes = NO_CODEC


def encode_header_into(
    buffer,
    *,
    layout_digest: bytes,
    key: bytes,
    payload_bytes: int,
    checksum: int,
    flags: int = 0,
    salt: bytes = _NO_SALT,
    key_id: int = 0,
    codec: bytes = NO_CODEC,
) -> None:
    """Write the header of a block into the first :data:`HEADER_BYTES` of ``buffer``.

    ``buffer`` is writable (a per-thread page-aligned scratch page); the bytes after the
    header are zeroed so that a block's header page is the same whatever the buffer held.
    A keyed block (``flags``) is written with a zero tag, then sealed with :func:`set_tag`.
    ``codec``: the descriptor of the codec the payload is encoded with (version 3); without
    one the header is version 2.
    """
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    view = memoryview(buffer)
    # the field version 1 reserved holds key_id; covered by the MAC and the header checksum
    common = (_MAGIC, key_id, flags, layout_digest, payload_bytes, checksum, salt, _NO_TAG)
    if codec == NO_CODEC:
        fixed = _FIXED
        _FIXED.pack_into(view, 0, common[0], 2, *common[1:], len(key))
    else:
        fixed = _FIXED_V3
        _FIXED_V3.pack_into(view, 0, common[0], 3, *common[1:], codec, len(key))
    end = fixed.size + len(key)
    view[fixed.size : end] = key
    _HEADER_SUM.pack_into(view, end, xxhash.xxh3_64_intdigest(view[:end]))
    tail = end + _HEADER_SUM.size
    view[tail:HEADER_BYTES] = _ZEROS[tail:]


def _fixed_size(view: memoryview) -> int:
    """The fixed part's size of the version-2 or -3 header in ``view``."""
    return _FIXED_SIZE.get(struct.unpack_from("<H", view, 8)[0], _FIXED.size)


def mac_parts(buffer) -> tuple[memoryview, memoryview]:
    """The bytes of an encoded version-2 or -3 header that a keyed block's MAC covers:
    everything before the header's own checksum except the tag, as two views (before and
    after it)."""
    view = memoryview(buffer)
    size = _fixed_size(view)
    (key_len,) = struct.unpack_from("<H", view, size - 2)
    return view[:_TAG_AT], view[_TAG_AT + TAG_BYTES : size + key_len]


def header_flags(buffer) -> int:
    """The flags of the version-2 header encoded in ``buffer`` (not checked: for a writer)."""
    return struct.unpack_from("<I", buffer, 12)[0]


def set_tag(buffer, tag: bytes) -> None:
    """Put ``tag`` into the header encoded in ``buffer`` and renew the header's checksum."""
    view = memoryview(buffer)
    view[_TAG_AT : _TAG_AT + TAG_BYTES] = tag
    size = _fixed_size(view)
    (key_len,) = struct.unpack_from("<H", view, size - 2)
    end = size + key_len
    _HEADER_SUM.pack_into(view, end, xxhash.xxh3_64_intdigest(view[:end]))


def decode_header(buffer) -> BlockHeader | str:
    """The header in ``buffer``'s first page, or the reason it is not a valid header."""
    view = memoryview(buffer)
    if len(view) < HEADER_BYTES:
        return "truncated"
    magic, version = struct.unpack_from("<8sH", view, 0)
    if magic != _MAGIC:
        return "bad magic"
    if version not in READ_VERSIONS:
        return f"format version {version}"
    salt, tag, key_id, codec = _NO_SALT, _NO_TAG, 0, NO_CODEC
    if version == 1:
        _m, _v, _reserved, flags, digest, payload_bytes, checksum, key_len = _FIXED_V1.unpack_from(view, 0)
        start = _FIXED_V1.size
        if flags:
            return "header checksum"  # version 1 never set a flag
    elif version == 2:
        _m, _v, key_id, flags, digest, payload_bytes, checksum, salt, tag, key_len = _FIXED.unpack_from(
            view, 0
        )
        start = _FIXED.size
    else:
        _m, _v, key_id, flags, digest, payload_bytes, checksum, salt, tag, codec, key_len = (
            _FIXED_V3.unpack_from(view, 0)
        )
        start = _FIXED_V3.size
    if version > 1:
        if flags & ~(FLAG_KEYED | FLAG_ENCRYPTED) or flags == FLAG_ENCRYPTED:
            return "header checksum"  # no writer sets these: damage (or a reader too old)
    if key_len > MAX_KEY_BYTES:
        return "header checksum"  # a length this large can only be damage
    end = start + key_len
    (stored_sum,) = _HEADER_SUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_sum:
        return "header checksum"
    return BlockHeader(
        version, digest, payload_bytes, checksum, bytes(view[start:end]), flags, salt, tag, key_id, codec
    )


def verify(
    header_page,
    payload: np.ndarray | memoryview | bytearray,
    nread: int,
    *,
    key: bytes,
    layout_digest: bytes,
    payload_bytes: int,
    keys=None,
    source=None,
    codec: bytes = NO_CODEC,
    exact: bool = True,
) -> str | None:
    """Why the block just read is not ``key``'s block of this layout, or ``None`` if it is.

    ``nread`` is how many bytes the read returned (header page + payload); ``payload`` is
    where the payload landed (the CPU row, or a codec's buffer), at least the stored payload
    long: what the header says is stored, ``payload_bytes`` when ``exact``, at most that
    otherwise (a codec whose blocks vary in size). The checks run cheapest first; the payload
    checksum (xxh3-64, ~15 GB/s) runs only when all else holds, over the stored bytes.
    ``codec``: the descriptor of the codec this reader decodes with; a block of another
    (or of none, when this reader has one) is refused before anything else is looked at.
    ``keys`` (a :class:`~kvtier.tiers.secret.TierKeys`, for a tier with a secret): the block
    must be keyed and its tag must hold under them; an encrypted payload is decrypted in
    place, or from ``source`` (the ciphertext, where it is not already in ``payload``). Without
    ``keys`` a keyed block is refused (it cannot be verified).
    Reasons: ``truncated``, ``bad magic``, ``format version N``, ``header checksum``,
    ``other codec``, ``other layout``, ``other key``, ``payload length``, ``checksum``,
    ``unkeyed``, ``keyed (no secret here)``, ``other secret``, ``MAC``.
    """
    if nread < HEADER_BYTES:
        return "truncated"
    header = decode_header(header_page)
    if isinstance(header, str):
        return header
    if header.codec != codec:
        return "other codec"
    if header.layout_digest != layout_digest:
        return "other layout"
    if header.key != key:
        return "other key"
    stored = header.payload_bytes
    if stored != payload_bytes if exact else stored > payload_bytes:
        return "payload length"
    if nread < HEADER_BYTES + stored:
        return "truncated"
    if stored != len(payload):
        payload = payload[:stored]
        source = None if source is None else source[:stored]
    if header.flags & FLAG_KEYED:
        # Checked before the payload is trusted: without the secret no one can make a tag hold.
        if keys is None:
            return "keyed (no secret here)"
        if header.key_id and header.key_id != keys.key_id:
            return "other secret"  # written under another secret: its tag cannot hold here
        return keys.open(header_page, header, payload, source)
    if keys is not None:
        return "unkeyed"  # written without the secret, or planted: never served with one
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        return "checksum"
    return None

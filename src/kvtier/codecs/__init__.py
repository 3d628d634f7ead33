"""Block codecs: what a lower tier stores in place of a raw block, chosen per tier by name.

``codec:`` in a disk or valkey tier's section names one: ``none`` (the default: the block as
it is), ``lossless`` (byte planes + zstd), or a lossy one, ``int8``, ``fp8``, ``int4``
(opt-in; their cost to a model is written beside each). Lossy codecs need the KV's element
dtype, which the layout fingerprint carries (``LayoutFingerprint.dtype``); where it names no
float dtype (kvtier standalone: raw bytes) they are refused at open, naming the fix.

A codec is a :class:`~kvtier.codecs.base.BlockCodec` in a module of its own, registered here
by name (or named by class path, ``my_pkg.codecs:MyCodec``, like an eviction policy). The
tiers call it on their own I/O threads: encode after a block is read from the CPU row and
before it is written; decode after what was read has been verified, into the CPU row.
"""

from __future__ import annotations

from kvtier.codecs.base import NO_CODEC, BlockCodec, CodecError, element_dtype
from kvtier.errors import ConfigError
from kvtier.registry import Registry

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "NO_CODEC",
    "BlockCodec",
    "CodecError",
    "element_dtype",
    "make_codec",
    "parse_codec_option",
]

#: codec name -> "module:Class", imported on first use
CODECS: Registry[BlockCodec] = Registry(
    "codec",
    BlockCodec,
    {
        "lossless": "kvtier.codecs.lossless:LosslessCodec",
        "int8": "kvtier.codecs.int8:Int8Codec",
        "fp8": "kvtier.codecs.fp8:FP8Codec",
        "int4": "kvtier.codecs.int4:Int4Codec",
    },
    module_key="codec",
)
#: what ``codec:`` accepts besides a class path
CODEC_NAMES = ("none", *CODECS.names())


def parse_codec_option(section, field: str) -> dict[str, object]:
    """``codec`` from a tier ``section`` (a keyword argument for its config class): a
    registered name or a class path, checked to resolve now, so a typo fails at load."""
    if "codec" not in section:
        return {}
    name = section["codec"]
    if name is None or name is False:
        name = "none"
    if not isinstance(name, str) or (
        name != "none" and name not in CODECS and not CODECS.is_class_path(name)
    ):
        raise ConfigError(
            f"{field}.codec",
            name,
            "one of " + ", ".join(CODEC_NAMES) + ", or a class path module:Class",
            "lossless keeps every bit; int8, fp8 and int4 are lossy (docs/tiers/codecs.md)",
        )
    if name != "none":
        CODECS.resolve(name, field=f"{field}.codec")
    return {"codec": name}


def make_codec(name: str, block_bytes: int, dtype: object, field: str) -> BlockCodec | None:
    """The codec ``name`` for blocks of ``block_bytes`` whose layout names element ``dtype``
    (a :class:`~kvtier.tiers.disk.format.LayoutFingerprint`'s), or None for ``none``.

    Called once by a tier's opener. Raises :class:`ConfigError` naming ``<field>.codec`` for a
    lossy codec without a float dtype, or a block that is not whole groups of it.
    """
    if name == "none":
        return None
    cls = CODECS.resolve(name, field=f"{field}.codec")
    elements = element_dtype(dtype)
    if cls.lossy and elements is None:
        raise ConfigError(
            f"{field}.codec",
            name,
            f"a lossless codec (none, lossless): {name} needs the KV's element dtype (bfloat16, "
            f"float16 or float32), and this layout's is {dtype!r}",
            "give the engine's KV dtype (TieredOffloadingSpec(kv_dtype=...), or the "
            "LayoutFingerprint's dtype), or use codec: lossless",
        )
    try:
        return cls(block_bytes, elements)
    except CodecError as exc:
        raise ConfigError(
            f"{field}.codec",
            name,
            f"a codec whose groups divide the block ({exc})",
            "use codec: lossless, or a block size of whole groups",
        ) from None

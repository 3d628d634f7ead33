"""The interface every block codec implements, and what a codec knows of a block's elements.

A codec turns one block (a CPU-tier row of ``block_bytes`` bytes) into the bytes a lower tier
stores, and back. It is built once per tier, from the tier's ``codec:`` name and the layout's
element dtype (:class:`~kvtier.tiers.disk.format.LayoutFingerprint` ``dtype``), and is then
used by the tier's I/O threads, never by the scheduler.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from typing import ClassVar

import ml_dtypes
import numpy as np

from kvtier.tiers.disk.format import CODEC_BYTES, NO_CODEC

__all__ = [
    "ELEMENT_DTYPES",
    "NO_CODEC",
    "BlockCodec",
    "CodecError",
    "element_dtype",
]

# name (8 ASCII bytes), element dtype code, the codec's own format version, elements per
# group, decoded bytes of the block
_DESCRIPTOR = struct.Struct("<8sBBHI")
assert _DESCRIPTOR.size == CODEC_BYTES

#: element dtypes a codec can know a block's bytes as, by canonical name, with their code
#: in a descriptor and their numpy type (bfloat16: ``ml_dtypes``', whose casts round to nearest)
ELEMENT_DTYPES: dict[str, tuple[int, type]] = {
    "bfloat16": (1, ml_dtypes.bfloat16),
    "float16": (2, np.float16),
    "float32": (3, np.float32),
}
# what engines and users call them (vLLM writes torch's names)
_ALIASES = {
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "torch.half": "float16",
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "torch.float": "float32",
}


def element_dtype(name: object) -> str | None:
    """The canonical element dtype a layout's ``dtype`` names (``bfloat16``, ``float16``,
    ``float32``), or None when it names none of them (raw bytes, integers, fp8)."""
    text = str(name).strip().lower()
    text = _ALIASES.get(text, text)
    return text if text in ELEMENT_DTYPES else None


class CodecError(ValueError):
    """A stored payload its codec cannot decode (a bug or a forgery that passed verification:
    the tier counts it as a corrupt block, never serves it)."""


class BlockCodec(ABC):
    """One way of storing a block: :meth:`encode_into` and :meth:`decode_into`.

    Built by :func:`kvtier.codecs.make_codec` with the block's size and element dtype (None:
    unknown, raw bytes); a lossy codec (``lossy``) needs a dtype and is only built with one.

    Who calls it: a lower tier's I/O threads, many at once: the methods must be thread-safe
    and must not hold the GIL for long (numpy and zstd release it). Never the scheduler.

    What a codec must do: ``decode(encode(block))`` gives the block back byte for byte when
    it is lossless; when lossy, a block that went through it once comes back unchanged if it
    goes through again (``decode(encode(decode(encode(b)))) == decode(encode(b))``), so a
    block reloaded and stored again loses nothing more. The encoded size is at most
    :attr:`max_encoded_bytes`, and exactly that when :attr:`fixed_size`. Decoding never
    trusts its input beyond what verification proved (the tier checks the stored bytes'
    checksum or MAC first): malformed input raises :class:`CodecError`, never writes past
    ``out``.
    """

    #: the name in configuration (``codec: int8``) and in block headers (at most 8 ASCII bytes)
    name: ClassVar[str] = ""
    #: whether decoding gives back something other than the block stored
    lossy: ClassVar[bool] = False
    #: version of the codec's stored format (in the descriptor; a reader of another refuses)
    format_version: ClassVar[int] = 1

    def __init__(self, block_bytes: int, dtype: str | None):
        #: bytes of one block (decoded)
        self.block_bytes = block_bytes
        #: the canonical element dtype, or None (raw bytes)
        self.dtype = dtype
        code, storage = ELEMENT_DTYPES[dtype] if dtype is not None else (0, np.uint8)
        #: bytes of one element (1 when the dtype is unknown)
        self.element_bytes = np.dtype(storage).itemsize
        self._dtype_code = code
        #: elements sharing one scale (0: the codec has no groups)
        self.group = 0

    @property
    @abstractmethod
    def max_encoded_bytes(self) -> int:
        """The most bytes an encoded block takes (what a tier reserves per block)."""

    @property
    def fixed_size(self) -> bool:
        """Whether every encoded block is exactly :attr:`max_encoded_bytes` long."""
        return True

    @property
    def descriptor(self) -> bytes:
        """What a block header records of this codec: name, element dtype, format version,
        group and decoded size; a reader decodes only blocks whose descriptor equals its own."""
        return _DESCRIPTOR.pack(
            self.name.encode("ascii"),
            self._dtype_code,
            self.format_version,
            self.group,
            self.block_bytes,
        )

    def describe(self) -> str:
        """One line for logs and stats: ``int8 (bfloat16, groups of 64)``."""
        parts = [self.dtype or "raw bytes"] + ([f"groups of {self.group}"] if self.group else [])
        return f"{self.name} ({', '.join(parts)})"

    @abstractmethod
    def encode_into(self, block: np.ndarray, out: np.ndarray) -> int:
        """Encode ``block`` (``block_bytes`` uint8) into ``out`` (uint8, at least
        :attr:`max_encoded_bytes`); the bytes written."""

    @abstractmethod
    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        """Decode ``payload`` (uint8, as :meth:`encode_into` wrote it) into ``out`` (uint8,
        ``block_bytes``). Raises :class:`CodecError` for a payload it cannot decode."""

    def encode(self, block: np.ndarray) -> bytes:
        """``block`` encoded (a convenience over :meth:`encode_into`)."""
        out = np.empty(self.max_encoded_bytes, dtype=np.uint8)
        return out[: self.encode_into(np.ascontiguousarray(block).view(np.uint8).reshape(-1), out)].tobytes()

    def decode(self, payload: bytes | np.ndarray) -> np.ndarray:
        """The block ``payload`` encodes, as ``block_bytes`` uint8 (over :meth:`decode_into`)."""
        out = np.empty(self.block_bytes, dtype=np.uint8)
        self.decode_into(np.frombuffer(payload, dtype=np.uint8), out)
        return out

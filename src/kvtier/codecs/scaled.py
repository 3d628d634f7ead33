"""What the lossy codecs share: groups of elements stored as small codes times one scale.

A block of bf16, fp16 or fp32 elements is cut into groups of ``group`` consecutive elements
(one token's channels of one head, for the usual KV layouts). Symmetric codecs (int8, fp8)
store each group's scale, ``max |x| / qmax`` rounded to the element dtype, and one code per
element, the element over the scale rounded to the codec's grid; decoding multiplies back and
rounds to the element dtype. An asymmetric codec (int4) also stores the group's smallest
element as its offset, and its scale spans ``max - min`` over codes ``0 .. qmax``: with 16
levels, a group that is not centred on zero (K's outlier channels) keeps all of them. Stored
form: every group's scale, then (asymmetric) every group's offset, both in the element dtype's
bytes, then every group's codes.

Scales in the element dtype, not fp32: bf16 scales keep int8 at 1.94x (fp32 scales: 1.88x),
and they make the codec idempotent. A block decoded and encoded again (a block a load brought
back and a later store writes down) must come back unchanged, or every trip through the tier
would add error. For almost every group that holds by construction: the extreme elements
decode to ``offset`` and ``offset + qmax * scale`` and give the same scale again, and every
other code lands back on itself (the element dtype's rounding moves it by far less than half a
step). The few groups where that rounding lands elsewhere (1 in 128 scales in bf16, and
groups whose offset dwarfs their span) are found from the scales and offsets alone and
re-encoded from their own decode until they are a fixed point (once or twice), so what is
stored is always a decode that encodes to itself.

Who calls it: the codecs' ``encode_into``/``decode_into``, on a tier's I/O threads. numpy only
(the scheduler's process never imports torch for a codec); ``ml_dtypes`` for bf16 and fp8.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvtier.codecs.base import ELEMENT_DTYPES, BlockCodec, CodecError

__all__ = ["ScaledCodec"]

#: rounds of re-encoding a group from its own decode, at most, until it is a fixed point
_SETTLE_ROUNDS = 4
#: the element dtype's unit roundoff: how far its rounding moves a value, relatively
_ROUNDOFF = {"bfloat16": 2.0**-9, "float16": 2.0**-11, "float32": 2.0**-24}


def _extremes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's smallest and largest value. By halving the rows with elementwise minima and
    maxima: numpy reduces a short last axis row by row, two to three times slower."""
    low = high = values
    while low.shape[1] > 1 and low.shape[1] % 2 == 0:
        half = low.shape[1] // 2
        low = np.minimum(low[:, :half], low[:, half:])
        high = np.maximum(high[:, :half], high[:, half:])
    return low.min(axis=1), high.max(axis=1)


class ScaledCodec(BlockCodec):
    """A lossy codec of scaled groups (see the module docstring). A subclass sets
    :attr:`qmax`, :attr:`offset`, :attr:`default_group` and :attr:`code_bits`; one whose codes
    are not the integers from ``-qmax`` (``0`` with an offset) to ``qmax``, a byte each,
    overrides the code hooks."""

    lossy = True
    #: the largest code: a group's scale maps its largest element (magnitude) there
    qmax: ClassVar[float] = 0.0
    #: whether each group also stores its smallest element, and codes run from 0 (asymmetric)
    offset: ClassVar[bool] = False
    #: elements per group (and scale)
    default_group: ClassVar[int] = 64
    #: bits of one stored code
    code_bits: ClassVar[int] = 8

    def __init__(self, block_bytes: int, dtype: str | None):
        super().__init__(block_bytes, dtype)
        assert dtype is not None  # make_codec refuses a lossy codec without an element dtype
        self.group = self.default_group
        self._storage = np.dtype(ELEMENT_DTYPES[dtype][1])
        elements = block_bytes // self.element_bytes
        if block_bytes % self.element_bytes or elements % self.group:
            raise CodecError(
                f"a block of {block_bytes} bytes is not whole groups of {self.group} {dtype} values"
            )
        self._groups = elements // self.group
        self._param_bytes = self._groups * self.element_bytes  # of the scales, and of the offsets
        self._head_bytes = self._param_bytes * (2 if self.offset else 1)
        self._code_bytes = elements * self.code_bits // 8
        # an offset this many scales away from zero makes the dtype's rounding move a code
        self._far = 0.25 / _ROUNDOFF[dtype]

    @property
    def max_encoded_bytes(self) -> int:
        return self._head_bytes + self._code_bytes

    def _floats(self, block: np.ndarray) -> np.ndarray:
        """The block's elements as a new float32 array of shape (groups, group)."""
        return block.view(self._storage).astype(np.float32).reshape(self._groups, self.group)

    def _rounded(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float32) rounded to the element dtype (to nearest, ties to even), as float32."""
        if self._storage == np.float32:
            return values
        return values.astype(self._storage).astype(np.float32)

    # -- the codes ------------------------------------------------------------------------------

    def _to_codes(self, scaled: np.ndarray) -> np.ndarray:
        """Codes of ``scaled`` (float32, elements less their offset over their scale; may be
        overwritten): integers from ``-qmax`` (or 0, with an offset) to ``qmax``."""
        np.rint(scaled, out=scaled)
        np.clip(scaled, 0 if self.offset else -self.qmax, self.qmax, out=scaled)
        return scaled.astype(np.uint8 if self.offset else np.int8)

    def _code_values(self, codes: np.ndarray) -> np.ndarray:
        """The float32 value of each code."""
        return codes.astype(np.float32)

    def _pack(self, codes: np.ndarray, out: np.ndarray) -> None:
        """Write ``codes`` (groups, group) into ``out`` (``_code_bytes`` uint8)."""
        out[:] = codes.reshape(-1).view(np.uint8)

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        """The codes (groups, group) stored in ``packed``."""
        return packed.view(np.uint8 if self.offset else np.int8).reshape(self._groups, self.group)

    # -- encode / decode ------------------------------------------------------------------------

    def _quantize(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(codes, scales, offsets, top)`` of float32 ``values`` (groups, group; overwritten):
        each group's codes, its scale and offset (float32 on the dtype's grid; offsets 0 when
        symmetric) and the value of the code its largest element got."""
        low, high = _extremes(values)
        if self.offset:
            offsets, span = low, high - low  # the smallest element: on the grid already
        else:
            offsets, span = np.zeros_like(low), np.abs(np.maximum(high, -low))  # never -0.0
        scales = self._scale_of(span)
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        if self.offset:
            values -= offsets[:, None]
        values *= inverse[:, None]
        top = self._code_values(self._to_codes(span * inverse))
        return self._to_codes(values), scales, offsets, top

    def _scale_of(self, span: np.ndarray) -> np.ndarray:
        return self._rounded(span / np.float32(self.qmax))

    def _dequantize(self, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """float32 decoded values, not yet rounded to the dtype, of ``codes`` under ``scales``
        and ``offsets``."""
        values = self._code_values(codes)
        values *= scales[:, None]
        if self.offset:
            values += offsets[:, None]
        return values

    def _settle(self, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, top: np.ndarray) -> None:
        """Make every group a fixed point of decode-then-encode (see the module docstring),
        in place. A group whose largest element got code ``qmax``, whose scale comes back from
        its decoded extremes, and whose offset is within ``_far`` scales of zero is one
        already; the others are re-encoded from their own decode."""
        qmax = np.float32(self.qmax)
        again = self._scale_of(self._rounded(qmax * scales + offsets) - offsets)
        suspect = (scales > 0) & ((top != qmax) | (again != scales) | (np.abs(offsets) >= self._far * scales))
        if not suspect.any():
            return
        where = np.flatnonzero(suspect)
        part = codes[where], scales[where], offsets[where]
        for _ in range(_SETTLE_ROUNDS):
            new_codes, new_scales, new_offsets, _top = self._quantize(self._rounded(self._dequantize(*part)))
            if (
                np.array_equal(new_scales, part[1])
                and np.array_equal(new_offsets, part[2])
                and np.array_equal(new_codes.view(np.uint8), part[0].view(np.uint8))
            ):
                break
            part = new_codes, new_scales, new_offsets
        codes[where], scales[where], offsets[where] = part

    def encode_into(self, block: np.ndarray, out: np.ndarray) -> int:
        with np.errstate(all="ignore"):  # a block holding inf or NaN encodes to garbage, quietly
            codes, scales, offsets, top = self._quantize(self._floats(block))
            self._settle(codes, scales, offsets, top)
        out[: self._param_bytes].view(self._storage)[:] = scales
        if self.offset:
            out[self._param_bytes : self._head_bytes].view(self._storage)[:] = offsets
        self._pack(codes, out[self._head_bytes : self.max_encoded_bytes])
        return self.max_encoded_bytes

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        if len(payload) != self.max_encoded_bytes:
            raise CodecError(f"a {self.name} payload is {self.max_encoded_bytes} bytes, not {len(payload)}")
        scales = payload[: self._param_bytes].view(self._storage).astype(np.float32)
        offsets = payload[self._param_bytes : self._head_bytes].view(self._storage).astype(np.float32)
        with np.errstate(all="ignore"):
            values = self._dequantize(self._unpack(payload[self._head_bytes :]), scales, offsets)
            out.view(self._storage).reshape(values.shape)[...] = values  # rounded to the dtype

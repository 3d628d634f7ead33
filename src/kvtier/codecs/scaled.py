"""What the lossy codecs share: groups of elements stored as small codes times one scale.

A block of bf16, fp16 or fp32 elements is cut into groups of ``group`` consecutive elements
(one token's channels of one head, for the usual KV layouts); each group is stored as its
scale, ``max |x| / qmax`` rounded to the element dtype, and one code per element, the element
divided by the scale and rounded to the codec's grid (int8, fp8 e4m3, int4). Decoding
multiplies back and rounds to the element dtype. Stored form: every group's scale (in the
element dtype's bytes), then every group's codes.

Scales in the element dtype, not fp32: bf16 scales keep int8 at 1.94x (fp32 scales: 1.88x),
and they make the codec idempotent. A block decoded and encoded again (a block a load brought
back and a later store writes down) must come back unchanged, or every trip through the tier
would add error. For almost every group that holds by construction: the largest element
decodes to ``qmax * scale`` and gives the same scale again, and every other code lands back on
itself (the element dtype's rounding moves it by far less than half a step). The few groups
where the rounding of ``qmax * scale`` or of the scale itself lands elsewhere (1 in 128 scales
in bf16) are found from the scales alone and re-encoded from their own decode until they are
a fixed point (once or twice), so what is stored is always a decode that encodes to itself.

Who calls it: the codecs' ``encode_into``/``decode_into``, on a tier's I/O threads. numpy only
(the scheduler's process never imports torch for a codec); ``ml_dtypes`` for fp8.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvtier.codecs.base import ELEMENT_DTYPES, BlockCodec, CodecError

__all__ = ["ScaledCodec"]

#: rounds of re-encoding a group from its own decode, at most, until it is a fixed point
_SETTLE_ROUNDS = 4


def _largest_magnitudes(values: np.ndarray) -> np.ndarray:
    """Each row's largest ``|value|`` (never -0.0). By halving the rows with elementwise
    maxima: numpy reduces a short last axis row by row, two to three times slower."""
    found = np.abs(values)
    while found.shape[1] > 1 and found.shape[1] % 2 == 0:
        half = found.shape[1] // 2
        found = np.maximum(found[:, :half], found[:, half:])
    return found.max(axis=1)


class ScaledCodec(BlockCodec):
    """A lossy codec of scaled groups (see the module docstring). A subclass sets
    :attr:`qmax`, :attr:`default_group` and :attr:`code_bits`; one whose codes are not the
    integers up to ``qmax`` in a byte each overrides the code hooks."""

    lossy = True
    #: the largest code magnitude: a group's scale maps its largest element there
    qmax: ClassVar[float] = 0.0
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
        self._scale_bytes = self._groups * self.element_bytes
        self._code_bytes = elements * self.code_bits // 8

    @property
    def max_encoded_bytes(self) -> int:
        return self._scale_bytes + self._code_bytes

    # -- the element dtype -------------------------------------------------------------------

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
        """Codes of ``scaled`` (float32, elements over their scale; may be overwritten):
        integers from ``-qmax`` to ``qmax`` (a codec of another grid overrides this)."""
        np.rint(scaled, out=scaled)
        np.clip(scaled, -self.qmax, self.qmax, out=scaled)
        return scaled.astype(np.int8)

    def _code_values(self, codes: np.ndarray) -> np.ndarray:
        """The float32 value of each code."""
        return codes.astype(np.float32)

    def _pack(self, codes: np.ndarray, out: np.ndarray) -> None:
        """Write ``codes`` (groups, group) into ``out`` (``_code_bytes`` uint8)."""
        out[:] = codes.reshape(-1).view(np.uint8)

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        """The codes (groups, group) stored in ``packed``."""
        return packed.view(np.int8).reshape(self._groups, self.group)

    # -- encode / decode ------------------------------------------------------------------------

    def _quantize(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(codes, scales, top)`` of float32 ``values`` (groups, group; overwritten): each
        group's codes, its scale (float32 on the dtype's grid) and its largest code's value."""
        largest = _largest_magnitudes(values)
        scales = self._scale_of(largest)
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        values *= inverse[:, None]
        top = self._code_values(self._to_codes(largest * inverse))
        return self._to_codes(values), scales, top

    def _scale_of(self, largest: np.ndarray) -> np.ndarray:
        return self._rounded(largest / np.float32(self.qmax))

    def _dequantize(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """float32 decoded values (on the dtype's grid) of ``codes`` under ``scales``."""
        values = self._code_values(codes)
        values *= scales[:, None]
        return self._rounded(values)

    def _settle(self, codes: np.ndarray, scales: np.ndarray, top: np.ndarray) -> None:
        """Make every group a fixed point of decode-then-encode (see the module docstring),
        in place. A group whose largest code is ``qmax`` and whose scale comes back from
        ``qmax * scale`` is one already; the others are re-encoded from their own decode."""
        again = self._scale_of(self._rounded(np.float32(self.qmax) * scales))
        suspect = (scales > 0) & ((top != np.float32(self.qmax)) | (again != scales))
        if not suspect.any():
            return
        where = np.flatnonzero(suspect)
        part_codes, part_scales = codes[where], scales[where]
        for _ in range(_SETTLE_ROUNDS):
            new_codes, new_scales, _top = self._quantize(self._dequantize(part_codes, part_scales))
            if np.array_equal(new_scales, part_scales) and np.array_equal(
                new_codes.view(np.uint8), part_codes.view(np.uint8)
            ):
                break
            part_codes, part_scales = new_codes, new_scales
        codes[where] = part_codes
        scales[where] = part_scales

    def encode_into(self, block: np.ndarray, out: np.ndarray) -> int:
        with np.errstate(all="ignore"):  # a block holding inf or NaN encodes to garbage, quietly
            codes, scales, top = self._quantize(self._floats(block))
            self._settle(codes, scales, top)
        out[: self._scale_bytes].view(self._storage)[:] = scales
        self._pack(codes, out[self._scale_bytes : self.max_encoded_bytes])
        return self.max_encoded_bytes

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        if len(payload) != self.max_encoded_bytes:
            raise CodecError(f"a {self.name} payload is {self.max_encoded_bytes} bytes, not {len(payload)}")
        scales = payload[: self._scale_bytes].view(self._storage).astype(np.float32)
        codes = self._unpack(payload[self._scale_bytes :])
        with np.errstate(all="ignore"):
            values = self._code_values(codes)
            values *= scales[:, None]
            out.view(self._storage).reshape(values.shape)[...] = values  # rounded to the dtype

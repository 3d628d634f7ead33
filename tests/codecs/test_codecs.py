"""Each codec on its own: what it stores, what it gives back, what it refuses."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.bench.codec import synthetic_kv
from kvtier.codecs import CODEC_NAMES, CodecError, element_dtype, make_codec, parse_codec_option
from kvtier.codecs.base import ELEMENT_DTYPES
from kvtier.errors import ConfigError

LOSSY = ("int8", "fp8", "int4")
DTYPES = tuple(ELEMENT_DTYPES)
BLOCK = 64 * 1024


def values(block: np.ndarray, dtype: str) -> np.ndarray:
    return block.view(ELEMENT_DTYPES[dtype][1]).astype(np.float64)


@pytest.mark.parametrize("dtype", [*DTYPES, None])
def test_lossless_gives_every_byte_back_and_stores_less(dtype):
    codec = make_codec("lossless", BLOCK, dtype, "t")
    block = synthetic_kv(BLOCK, dtype=dtype or "bfloat16")
    stored = codec.encode(block)
    assert np.array_equal(codec.decode(stored), block)
    assert len(stored) < BLOCK  # KV's exponents repeat: fewer bytes, whatever the planes


def test_lossless_stores_an_incompressible_block_as_it_is():
    codec = make_codec("lossless", BLOCK, "bfloat16", "t")
    block = np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8)
    stored = codec.encode(block)
    assert stored == block.tobytes()  # never longer than the block: a tier reserves no more
    assert np.array_equal(codec.decode(stored), block)


def test_lossless_reaches_the_issue_ratio_on_kv_like_bf16():
    codec = make_codec("lossless", 2 << 20, "bfloat16", "t")
    block = synthetic_kv(2 << 20)
    assert (2 << 20) / len(codec.encode(block)) >= 1.4  # synthetic: the goal is for real KV


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LOSSY)
def test_a_lossy_codec_is_its_own_fixed_point(name, dtype):
    """A block decoded, encoded again and decoded is unchanged: error never compounds."""
    codec = make_codec(name, BLOCK, dtype, "t")
    block = synthetic_kv(BLOCK, seed=3, dtype=dtype)
    once = codec.decode(codec.encode(block))
    assert not np.array_equal(once, block)  # it is lossy
    assert codec.encode(once) == codec.encode(block)
    assert np.array_equal(codec.decode(codec.encode(once)), once)


@pytest.mark.parametrize(
    ("name", "ratio", "largest_error"),
    [("int8", 1.9393, 0.02), ("fp8", 1.9393, 0.03), ("int4", 3.2, 0.12)],
)
def test_a_lossy_codec_stores_its_stated_bytes_within_its_error(name, ratio, largest_error):
    codec = make_codec(name, BLOCK, "bfloat16", "t")
    block = synthetic_kv(BLOCK, seed=5)
    stored = codec.encode(block)
    assert len(stored) == codec.max_encoded_bytes and BLOCK / len(stored) == pytest.approx(ratio, abs=1e-3)
    original, back = values(block, "bfloat16"), values(codec.decode(stored), "bfloat16")
    relative = np.sqrt(np.mean((back - original) ** 2) / np.mean(original**2))
    assert 0 < relative < largest_error
    # no value is off by more than a step of its group, plus the bf16 rounding of both (half a
    # step, but a group re-encoded from its own decode to be a fixed point may add another half)
    groups = original.reshape(-1, codec.group)
    largest = np.abs(groups).max(axis=1, keepdims=True)
    span = groups.max(axis=1, keepdims=True) - groups.min(axis=1, keepdims=True)
    step = {
        "int8": largest / codec.qmax,
        "fp8": np.maximum(np.abs(groups) / 8, largest / 448 / 512),  # 3 mantissa bits, subnormals
        "int4": span / codec.qmax,  # 16 levels from the group's smallest to its largest
    }[name]
    error = np.abs(back.reshape(groups.shape) - groups)
    assert np.all(error <= step + 2**-7 * np.abs(groups) + 1e-30)
    assert np.mean(error <= 0.5 * step + 2**-7 * np.abs(groups) + 1e-30) > 0.99  # nearly all: half


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(LOSSY),
    st.sampled_from(DTYPES),
    st.floats(-30, 30),
    st.integers(0, 2**32 - 1),
)
def test_any_finite_block_round_trips_to_a_fixed_point(name, dtype, log_scale, seed):
    rng = np.random.default_rng(seed)
    storage = ELEMENT_DTYPES[dtype][1]
    limit = float(np.finfo(np.float16 if dtype == "float16" else np.float32).max) / 8  # finite
    raw = np.clip(rng.standard_normal(4096) * 2.0**log_scale, -limit, limit).astype(np.float32)
    raw[rng.random(4096) < 0.05] = 0  # zeros, and whole zero groups, are values too
    raw[:64] = 0
    block = raw.astype(storage).view(np.uint8)
    codec = make_codec(name, block.nbytes, dtype, "t")
    once = codec.decode(codec.encode(block))
    assert np.all(np.isfinite(values(once, dtype)))
    assert np.array_equal(codec.decode(codec.encode(once)), once)
    lossless = make_codec("lossless", block.nbytes, dtype, "t")
    assert np.array_equal(lossless.decode(lossless.encode(block)), block)


def test_a_malformed_payload_is_refused_never_decoded_past_its_end():
    lossless = make_codec("lossless", BLOCK, "bfloat16", "t")
    stored = bytearray(lossless.encode(synthetic_kv(BLOCK)))
    for bad, why in (
        (stored[:3], "no plane table"),
        (stored[:-1], "past the payload's end"),
        (stored + b"\0", "after the last plane"),
    ):
        with pytest.raises(CodecError, match=why):
            lossless.decode(bytes(bad))
    # what verification stops, the decoder refuses too: a plane table that lies, a frame garbled
    (low, high) = struct.unpack_from("<II", stored)
    assert high & 1 << 31 and not low & 1 << 31  # bf16: the high bytes compress, the low ones not
    for table in ((high, low), (low + 1, high), (low, high ^ 1 << 31)):
        forged = bytearray(stored)
        struct.pack_into("<II", forged, 0, *table)
        with pytest.raises(CodecError):
            lossless.decode(bytes(forged))
    garbled = bytearray(stored)
    frame = 8 + (low & ~(1 << 31))
    garbled[frame : frame + 8] = bytes(8)  # the zstd frame's magic and header
    with pytest.raises(CodecError, match="plane 1"):
        lossless.decode(bytes(garbled))
    int8 = make_codec("int8", BLOCK, "bfloat16", "t")
    with pytest.raises(CodecError, match="payload is"):
        int8.decode(int8.encode(synthetic_kv(BLOCK))[:-1])


def test_descriptors_tell_codecs_dtypes_and_sizes_apart():
    made = {
        (name, dtype, size): make_codec(name, size, dtype, "t").descriptor
        for name in CODEC_NAMES[1:]
        for dtype in DTYPES
        for size in (BLOCK, 2 * BLOCK)
    }
    assert len(set(made.values())) == len(made)
    assert all(len(descriptor) == 16 and any(descriptor) for descriptor in made.values())


def test_a_lossy_codec_without_an_element_dtype_is_refused_naming_the_fix():
    assert make_codec("none", BLOCK, "uint8", "tiers[1]") is None
    assert make_codec("lossless", BLOCK, "uint8", "tiers[1]") is not None  # bytes are fine
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec.*bfloat16.*kv_dtype"):
        make_codec("int8", BLOCK, "uint8", "tiers[1]")
    with pytest.raises(ConfigError, match="whole groups"):
        make_codec("int4", 1000, "bfloat16", "tiers[1]")


def test_dtype_names_engines_use_are_understood():
    assert element_dtype("torch.bfloat16") == element_dtype("bf16") == "bfloat16"
    assert element_dtype("torch.float16") == element_dtype("half") == "float16"
    assert element_dtype("float8_e4m3fn") is None and element_dtype("uint8") is None


def test_the_codec_key_is_checked_where_the_configuration_is_parsed():
    assert parse_codec_option({}, "tiers[1]") == {}
    assert parse_codec_option({"codec": "int4"}, "tiers[1]") == {"codec": "int4"}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.codec.*lossless, int8, fp8, int4"):
        parse_codec_option({"codec": "zstd"}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.codec"):
        parse_codec_option({"codec": "no_such_module:Codec"}, "tiers[2]")

"""``kvtier bench codec``: each codec's ratio and encode/decode GB/s on one core, against memcpy.

Protocol: ``mib`` MiB of KV blocks at each block size of ``block_sizes``; per codec (``none``
is the baseline: a copy of the block in and a copy out, what a tier without a codec costs at
most), each round encodes every block into one buffer, then decodes every block back, on the
calling thread; figures are the medians of ``rounds`` rounds, GB/s of *raw* block bytes
(10^9) per CPU-second of that thread (``time.thread_time``: GB/s per core, which other
processes competing for the cores do not change; the wall clock on a shared machine would
measure them), and ``*_vs_memcpy`` the median of each round's rate over the baseline's rate
in the same round. Every decoded block is compared with what the codec promises: the block
byte for byte (lossless), or its own encode -> decode, which encoding it again must give
back unchanged (lossy). How cost grows with block size: one row per size (a fixed cost per
block shows as lower GB/s at small sizes).

The blocks: without real KV, synthetic bf16 KV (:func:`synthetic_kv`), made to have what
real K and V have — a scale per channel spanning two orders of magnitude, an offset per
channel (K), per-token variation, and rare outliers — but it is not a model's KV, and its
lossless ratio is a stand-in for the real one (issue #33 measured 1.43x on SmolLM2-135M).
``rel_rms_error`` (the decode's RMS error over the data's RMS) says how much a lossy codec
perturbs these values; what that costs a model (:data:`MODEL_KEYS`: ``kl_mean``,
``ppl_delta``, ``greedy_agreement`` ...) needs a real model's KV and logits: those keys are
null here. ``kvtier bench codec --model`` (:mod:`kvtier.bench.codec_model`) measures them and
passes ``blocks`` of the model's KV and ``quality`` figures per codec.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from kvtier.bench.report import print_json, print_table
from kvtier.codecs import CODEC_NAMES, make_codec
from kvtier.errors import KvtierError

__all__ = ["BLOCK_SIZES", "MODEL_KEYS", "run", "synthetic_kv"]

#: block sizes measured by default: a small block, a mid one, a 2 MiB CPU row (vLLM's usual)
BLOCK_SIZES = (64 << 10, 512 << 10, 2 << 20)
#: what a real model's run adds per codec (null without one)
MODEL_KEYS = ("kl_mean", "kl_max", "ppl_delta", "ppl_reference", "greedy_agreement", "kl_by_text")
#: values per token and head: the channels a K or V row has (SmolLM2: 64; Llama: 128)
HEAD_DIM = 64


def synthetic_kv(nbytes: int, seed: int = 0, dtype: str = "bfloat16") -> np.ndarray:
    """``nbytes`` of KV-like values in ``dtype`` (bfloat16, float16, float32), as uint8.

    Tokens of :data:`HEAD_DIM` channels: each channel has its own scale (log-normal, about two
    orders of magnitude between the smallest and the largest) and offset (as K's outlier
    channels do), each token its own gain, and one value in 500 is ten times larger.
    Deterministic in ``seed``. Synthetic: for ratios and speeds, not for a model's error.
    """
    from kvtier.codecs.base import ELEMENT_DTYPES

    storage = np.dtype(ELEMENT_DTYPES[dtype][1])
    count = nbytes // storage.itemsize
    rng = np.random.default_rng(seed)
    channels = rng.lognormal(0.0, 1.0, HEAD_DIM).astype(np.float32)
    offsets = (rng.standard_normal(HEAD_DIM) * channels * (rng.random(HEAD_DIM) < 0.1)).astype(np.float32)
    values = rng.standard_normal((count // HEAD_DIM, HEAD_DIM), dtype=np.float32)
    values *= channels
    values += offsets
    values *= rng.lognormal(0.0, 0.25, (len(values), 1)).astype(np.float32)
    values[rng.random(values.shape) < 0.002] *= 10
    out = np.zeros(nbytes, dtype=np.uint8)
    out[: values.size * storage.itemsize] = values.astype(storage).view(np.uint8).reshape(-1)
    return out


class _Copy:
    """The baseline: a tier without a codec moves the block as it is (a copy in, a copy out)."""

    lossy = False

    def __init__(self, block_bytes: int):
        self.max_encoded_bytes = block_bytes

    def encode_into(self, block: np.ndarray, out: np.ndarray) -> int:
        out[: len(block)] = block
        return len(block)

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        out[:] = payload


def _buffers(codec: Any, blocks: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Where a round encodes to and decodes into: made once and written once, so no round
    times the first touch of its memory (page faults would halve memcpy's rate)."""
    encoded = np.ones(len(blocks) * codec.max_encoded_bytes, dtype=np.uint8)
    return encoded, [np.ones(len(block), dtype=np.uint8) for block in blocks]


def _round(
    codec: Any, blocks: Sequence[np.ndarray], encoded: np.ndarray, decoded: list[np.ndarray]
) -> tuple[float, float, int]:
    """One round, into the buffers of :func:`_buffers`: ``(encode seconds, decode seconds,
    encoded bytes)``."""
    spans = []
    at = 0
    start = time.thread_time()
    for block in blocks:
        written = codec.encode_into(block, encoded[at:])
        spans.append((at, written))
        at += written
    encode_s = time.thread_time() - start
    start = time.thread_time()
    for (first, length), out in zip(spans, decoded):
        codec.decode_into(encoded[first : first + length], out)
    decode_s = time.thread_time() - start
    return encode_s, decode_s, at


def _check(name: str, codec: Any, blocks: Sequence[np.ndarray], decoded: Sequence[np.ndarray]) -> None:
    """Decoded blocks are what the codec promises (see the module docstring), or raise."""
    for index, (block, back) in enumerate(zip(blocks, decoded)):
        if not codec.lossy:
            same = np.array_equal(block, back)
        else:
            again = codec.decode(codec.encode(back))  # a decoded block is a fixed point
            same = np.array_equal(again, back)
        if not same:
            raise KvtierError(f"codec {name}: block {index} did not come back as the codec promises")


def _rms_error(blocks: Sequence[np.ndarray], decoded: Sequence[np.ndarray], storage: np.dtype) -> float:
    """The decode's RMS error over the data's RMS (0 for a lossless codec)."""
    error = power = 0.0
    for block, back in zip(blocks, decoded):
        original = block.view(storage).astype(np.float64)
        error += float(np.square(back.view(storage).astype(np.float64) - original).sum())
        power += float(np.square(original).sum())
    return (error / power) ** 0.5 if power else 0.0


def run(
    *,
    codecs: Sequence[str] = CODEC_NAMES,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    mib: int = 32,
    rounds: int = 5,
    dtype: str = "bfloat16",
    blocks: Mapping[int, Sequence[np.ndarray]] | None = None,
    quality: Mapping[str, Mapping[str, Any]] | None = None,
    model: Mapping[str, Any] | None = None,
    data: str = "synthetic KV",
    out: TextIO | None = None,
    json_line: bool = False,
) -> dict[str, Any]:
    """Measure ``codecs`` (``none``, the memcpy baseline, always included) at each of
    ``block_sizes``; print a table to ``out`` (and, with ``json_line``, one JSON line);
    return the JSON record.

    ``blocks``: block size -> the blocks to measure (real KV, say), instead of ``mib`` MiB of
    :func:`synthetic_kv` per size; ``data`` names where they came from. ``quality``: codec ->
    its :data:`MODEL_KEYS` on a real model (null without); ``model``: how they were measured.
    Raises :class:`KvtierError` for bad arguments, or a block that came back wrong.
    """
    from kvtier.codecs.base import ELEMENT_DTYPES, element_dtype

    import sys

    out = out or sys.stdout
    if rounds < 1 or mib < 1 or not block_sizes:
        raise KvtierError("bench codec needs --rounds >= 1, --mib >= 1 and at least one block size")
    if element_dtype(dtype) != dtype:
        raise KvtierError(f"--dtype {dtype!r}: one of {', '.join(ELEMENT_DTYPES)}")
    unknown = [name for name in codecs if name not in CODEC_NAMES]
    if unknown:
        raise KvtierError(f"unknown codec {unknown[0]!r}: one of {', '.join(CODEC_NAMES)}")
    names = ["none", *[name for name in codecs if name != "none"]]
    storage = np.dtype(ELEMENT_DTYPES[dtype][1])
    rows: list[dict[str, Any]] = []
    lossy: dict[str, bool] = {}
    figures: dict[str, dict[str, Any]] = {name: {"by_block_bytes": {}} for name in names}
    for size in block_sizes:
        if blocks is not None:
            sample = list(blocks[size])
        else:
            count = max(1, (mib << 20) // size)
            sample = [synthetic_kv(size, seed=index, dtype=dtype) for index in range(count)]
        made = {
            name: _Copy(size) if name == "none" else make_codec(name, size, dtype, "bench") for name in names
        }
        lossy = {name: bool(getattr(made[name], "lossy", False)) for name in names}
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        buffers = {name: _buffers(made[name], sample) for name in names}
        ratios: dict[str, float] = {}
        errors: dict[str, float] = {}
        raw = size * len(sample)
        for round_index in range(rounds):
            # the order rotates between rounds: no codec always runs on a warm (or cold) cache
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                encoded, decoded = buffers[name]
                encode_s, decode_s, stored = _round(made[name], sample, encoded, decoded)
                timings[name].append((encode_s, decode_s))
                if round_index == 0:
                    _check(name, made[name], sample, decoded)
                    ratios[name] = raw / stored
                    errors[name] = _rms_error(sample, decoded, storage)
        base = timings["none"]
        for name in names:
            encode = statistics.median(raw / e / 1e9 for e, _ in timings[name])
            decode = statistics.median(raw / d / 1e9 for _, d in timings[name])
            row = {
                "codec": name,
                "block_bytes": size,
                "blocks": len(sample),
                "ratio": ratios[name],
                "encode_gbps": encode,
                "decode_gbps": decode,
                # each round's rate over the baseline's in the same round, then the median
                "encode_vs_memcpy": statistics.median(b[0] / t[0] for t, b in zip(timings[name], base)),
                "decode_vs_memcpy": statistics.median(b[1] / t[1] for t, b in zip(timings[name], base)),
                "rel_rms_error": errors[name],
            }
            rows.append(row)
            figures[name]["by_block_bytes"][str(size)] = {
                key: row[key] for key in ("ratio", "encode_gbps", "decode_gbps", "rel_rms_error")
            }
    largest = str(max(block_sizes))
    record: dict[str, Any] = {
        "bench": "codec",
        "data": data,
        "dtype": dtype,
        "rounds": rounds,
        "block_sizes": list(block_sizes),
        "codecs": {},
        "model": None if model is None else dict(model),
        "note": None
        if quality is not None
        else "kl_mean, ppl_delta and greedy_agreement need a real model's KV and logits (null here)",
    }
    for name in names:
        headline = figures[name]["by_block_bytes"][largest]
        record["codecs"][name] = {
            **headline,
            **{key: (quality or {}).get(name, {}).get(key) for key in MODEL_KEYS},
            "lossy": lossy[name],
            "by_block_bytes": figures[name]["by_block_bytes"],
        }
    print(
        f"kvtier bench codec: {data} ({dtype}), {len(names)} codecs (none = memcpy, the baseline), "
        f"{rounds} rounds (medians), one core; GB/s of raw block bytes per CPU-second",
        file=out,
    )
    print_table(
        rows,
        [
            "codec",
            "block_bytes",
            "ratio",
            "encode_gbps",
            "decode_gbps",
            "encode_vs_memcpy",
            "decode_vs_memcpy",
            "rel_rms_error",
        ],
        out,
    )
    if quality is None:
        print("model error (kl_mean, ppl_delta, greedy_agreement): needs a real model's KV", file=out)
    else:
        print(
            "model error: KL(reference || codec) per position, nats; perplexity change; top-1 agreement",
            file=out,
        )
        print_table(
            [{"codec": name, **record["codecs"][name]} for name in names],
            ["codec", "kl_mean", "kl_max", "ppl_delta", "greedy_agreement"],
            out,
        )
    if json_line:
        print_json(record, out)
    return record

"""Shared test helpers: keys and deterministic payloads."""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.base import OffloadKey, make_offload_key


def key(i: int, group: int = 0) -> OffloadKey:
    """A 32-byte-hash key, as vLLM makes them, for integer ``i``."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


def payload(k: bytes, nbytes: int) -> np.ndarray:
    """Bytes that only ``k`` produces: a wrong block can never pass for the right one."""
    seed = int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

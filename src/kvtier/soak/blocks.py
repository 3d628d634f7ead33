"""Keys and payloads of the soak: every block's bytes follow from its key alone.

So any process can tell a right block from a wrong one without being told what was stored:
a block served with another key's bytes, or with damage, never compares equal.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.base import OffloadKey, make_offload_key

__all__ = ["block_key", "payload", "is_exact"]


def block_key(i: int, salt: str = "") -> OffloadKey:
    """The soak's key number ``i`` (a 32-byte hash, as an engine makes them) in namespace ``salt``."""
    return make_offload_key(hashlib.sha256(f"{salt}/{i}".encode()).digest(), 0)


def payload(key: bytes, nbytes: int, kv: bool = False) -> np.ndarray:
    """``nbytes`` bytes only ``key`` produces (seeded from a hash of the key): random, or
    with ``kv`` bf16 KV-like values, which a lossless codec compresses about 1.4x (the
    replay's, :func:`kvtier.replay.engine.block_bytes_of`)."""
    if kv:
        from kvtier.replay.engine import block_bytes_of

        return block_bytes_of(OffloadKey(key), nbytes, kv_like=True).view(np.uint8)
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def is_exact(row: np.ndarray, key: bytes, kv: bool = False) -> bool:
    """Whether ``row`` holds exactly ``key``'s block (``kv``: as :func:`payload` makes it)."""
    return bool(np.array_equal(row, payload(key, row.shape[0], kv)))

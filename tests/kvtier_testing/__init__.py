"""Shared test helpers: keys, deterministic payloads, store and load through a manager.

pytest puts ``tests/`` on the path (``pythonpath`` in pyproject.toml), so tests import this
package by name. Beside it: ``store`` (disk-tier rows, configs, synchronous jobs, damage),
``valkey_tier`` (an open valkey tier, waiting on its threads), ``fault_fs`` (real tmpfs and
ext4 faults), ``fault_stack`` (a CPU + disk stack driven like an engine) and ``conformance``
(the lower-tier conformance suite's harnesses). Fixtures stay in the conftest.py files.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.base import OffloadKey, make_offload_key
from kvtier.soak.blocks import payload  # bytes only a key produces: a wrong block never passes


def key(i: int, group: int = 0) -> OffloadKey:
    """A 32-byte-hash key, as vLLM makes them, for integer ``i``."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


def kv_payload(k: bytes, nbytes: int) -> np.ndarray:
    """bf16 KV-like values (as uint8) that only ``k`` produces, for codecs that read values."""
    from kvtier.bench.codec import synthetic_kv

    return synthetic_kv(nbytes, seed=int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little"))


def store_blocks(manager, keys, ctx, success: bool = True, make=payload):
    """Offer ``keys``, write each new block's own bytes (``make(key, nbytes)``) into its row
    (the worker's copy), complete the store; the PrepareStoreOutput (asserted not None)."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    rows = manager.backend.rows
    nbytes = rows.shape[1]
    for k, row in zip(out.keys_to_store, out.store_spec.block_ids):
        rows[row] = make(k, nbytes)
    manager.complete_store(keys, ctx, success)
    return out


def read_blocks(manager, keys, ctx) -> list[np.ndarray]:
    """Load ``keys`` (prepare, copy each row out, complete); the copies, in key order."""
    spec = manager.prepare_load(keys, ctx)
    got = [manager.backend.rows[row].copy() for row in spec.block_ids]
    manager.complete_load(keys, ctx)
    return got

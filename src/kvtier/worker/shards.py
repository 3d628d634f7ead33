"""Where each worker's shard of a block lives inside one CPU row: pure arithmetic, no torch.

A tensor- or pipeline-parallel engine splits every KV block across its workers: each TP rank
holds its heads, each PP stage its layers. kvtier keeps one CPU row per block all the same
(one key, one row, one disk block), with the workers' shards side by side in rank order::

    row:  | shard 0 (rank 0) | shard 1 (rank 1) | ... | shard n-1 | padding to 4 KiB |
    each shard: the worker's own row layout (kvtier.worker.blocks), shard_bytes long

Every worker has the same ``shard_bytes`` (vLLM sizes every worker's KV cache alike, and so
does the standalone spec); worker ``r`` copies only bytes ``[offset, offset + shard_bytes)``
of each row. The scheduler side never sees shards: it allocates rows of ``row_bytes``.

Replicated KV (an MLA latent cache is the same on every TP rank): ``kv_replicas`` consecutive
ranks hold identical bytes, so the row holds one shard per run of replicas, the first rank of
each run writes it and every rank of the run reads it. A non-writing rank still answers each
store job (successfully, having copied nothing), so "every rank finished" keeps meaning the
same thing to whoever aggregates the results.

Any process, any thread; values only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kvtier.errors import ConfigError

__all__ = ["ShardPlacement"]


def _int_at_least(field: str, value: object, low: int) -> int:
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # TypeError for a non-integer
    except TypeError:
        number = low - 1
    if isinstance(value, bool) or number < low:
        raise ConfigError(field, value, f"an integer >= {low}")
    return number


@dataclass(frozen=True)
class ShardPlacement:
    """One worker's place in the rows: which shard it copies, where, and whether it writes."""

    #: workers of the engine (tensor x pipeline x context parallel)
    world_size: int
    #: this worker, in ``[0, world_size)``; ranks of one TP group are consecutive
    rank: int
    #: bytes of one worker's shard of a block (block_size_factor x its pages)
    shard_bytes: int
    #: how many consecutive ranks hold byte-identical KV (1: none; the TP size for MLA)
    kv_replicas: int = 1

    def __post_init__(self) -> None:
        world = _int_at_least("world_size", self.world_size, 1)
        replicas = _int_at_least("kv_replicas", self.kv_replicas, 1)
        _int_at_least("shard_bytes", self.shard_bytes, 1)
        rank = _int_at_least("rank", self.rank, 0)
        if rank >= world:
            raise ConfigError("rank", rank, f"a worker index in [0, {world}) (world_size {world})")
        if world % replicas:
            raise ConfigError(
                "kv_replicas",
                replicas,
                f"a divisor of world_size {world}: runs of identical ranks tile the workers",
                "give the tensor-parallel size for an MLA cache replicated across TP, else 1",
            )

    @classmethod
    def single(cls, shard_bytes: int) -> ShardPlacement:
        """One worker holding the whole block (no parallelism)."""
        return cls(world_size=1, rank=0, shard_bytes=shard_bytes)

    @property
    def num_shards(self) -> int:
        """Distinct shards in a row: ``world_size / kv_replicas``."""
        return self.world_size // self.kv_replicas

    @property
    def shard(self) -> int:
        """Which shard of the row this worker copies."""
        return self.rank // self.kv_replicas

    @property
    def writes(self) -> bool:
        """Whether this worker's stores copy bytes (the first rank of each run of replicas)."""
        return self.rank % self.kv_replicas == 0

    @property
    def offset(self) -> int:
        """Bytes from the start of a row to this worker's shard."""
        return self.shard * self.shard_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of a whole row (every shard): what the CPU tier and the disk tiers hold."""
        return self.num_shards * self.shard_bytes

    def describe(self) -> str:
        """The shard layout in a few words, for a layout fingerprint and for logs."""
        return (
            f"shards={self.num_shards}x{self.shard_bytes};world={self.world_size};replicas={self.kv_replicas}"
        )

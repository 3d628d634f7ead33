"""The worker side: handlers that move KV blocks between the engine's GPU cache and the CPU tier.

``blocks`` (pure numpy: the row layout and the copy plan), ``shards`` (each rank's place in
a row under tensor/pipeline parallelism), ``aggregate`` (one result per job from every
rank's), ``engines`` (how bytes move: CUDA
streams or a background thread), ``cpu_gpu`` (the contract's handlers), ``worker`` (routing
jobs to handlers by media), ``canonical`` (canonical tensors from raw caches).

The names below are imported on first use: ``kvtier.worker.blocks`` is numpy only and must
stay importable without torch, which the other modules need.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CpuGpuOffloadingHandlers",
    "OffloadingWorker",
    "RankResultAggregator",
    "ShardPlacement",
    "SingleDirectionOffloadingHandler",
    "TransferLayout",
    "canonicalize",
    "expand_block_ids",
]

_HOMES = {
    "CpuGpuOffloadingHandlers": "kvtier.worker.cpu_gpu",
    "SingleDirectionOffloadingHandler": "kvtier.worker.cpu_gpu",
    "OffloadingWorker": "kvtier.worker.worker",
    "RankResultAggregator": "kvtier.worker.aggregate",
    "ShardPlacement": "kvtier.worker.shards",
    "TransferLayout": "kvtier.worker.blocks",
    "expand_block_ids": "kvtier.worker.blocks",
    "canonicalize": "kvtier.worker.canonical",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtier.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)

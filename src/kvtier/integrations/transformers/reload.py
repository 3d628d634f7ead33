"""A prefix stored through a stack, reloaded, and the continuation's logits both ways.

What a lossy codec costs is measured with this: :func:`reload_logits` gives the logits the
model computes over KV that went through the tiers (and their codecs) beside the logits over
the same KV kept in memory, at the same split, so any difference is the tiers'. Without a
codec (or with a lossless one) the two are bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import KvtierConfig, load_config
from kvtier.integrations.transformers.cache import TieredPrefixCache, cache_prefix, forward

__all__ = ["Reloaded", "reload_logits"]


@dataclass
class Reloaded:
    """The continuation's logits over the reloaded prefix and over the in-memory one."""

    #: ``(len(continuation), vocab)``: the prefix's KV loaded through the tiers
    tiered: torch.Tensor
    #: the same positions over the in-memory cache of the prefix, at the same split
    memory: torch.Tensor
    #: tokens whose KV the tiers served (the split)
    cached_tokens: int
    #: blocks loaded, by the tier that served them
    hits: dict[str, int]
    #: the reloading stack's counters, once closed (misses by cause, bytes per tier ...)
    stats: dict[str, float]


def reload_logits(
    model: Any,
    config: KvtierConfig | dict | str,
    prefix_ids: Sequence[int],
    continuation_ids: Sequence[int],
    *,
    reload_config: KvtierConfig | dict | str | None = None,
    model_id: str | None = None,
    kv_dtype: str | None = None,
    engine: str = "auto",
) -> Reloaded:
    """Prefill ``prefix_ids`` through a stack built from ``config`` (storing its full blocks),
    then prefill ``prefix_ids + continuation_ids`` loading them back; the continuation's
    logits both ways.

    With tiers below the CPU tier, or a ``reload_config``, the first stack is closed (which
    saves every block below) and a second one opened on ``reload_config`` (default:
    ``config`` again), so the prefix comes back from the lower tiers, through their checks and
    codecs; with a CPU tier alone, from it. A ``reload_config`` sharing only some of the
    tiers is another engine: one sharing only the Valkey tier reads from it. ``kv_dtype``:
    the dtype the tiers store the KV in (see :class:`TieredPrefixCache`); the in-memory cache
    is rounded to it too, so the two differ by what the tiers do alone. ``engine``: the copy
    engine between the model's device and the CPU tier (``auto``: DMA on CUDA).
    """
    parsed = load_config(config)
    prefix = [int(t) for t in prefix_ids]
    continuation = [int(t) for t in continuation_ids]
    first = TieredPrefixCache(model, parsed, model_id=model_id, kv_dtype=kv_dtype, engine=engine)
    try:
        stored = first.prefill(prefix)
        if len(parsed.tiers) > 1 or reload_config is not None:
            first.close()
            # the weights are hashed once
            second = TieredPrefixCache(
                model,
                reload_config or parsed,
                model_id=first.layout.weights,
                kv_dtype=kv_dtype,
                engine=engine,
            )
        else:
            second = first
        try:
            loaded = second.prefill(prefix + continuation, logits=len(continuation), store=False)
        finally:
            second.close()
    finally:
        first.close()
    split = loaded.cached_tokens
    memory = forward(
        model,
        (prefix + continuation)[split:],
        cache_prefix(model, stored.cache, split, kv_dtype),
        len(continuation),
    )
    return Reloaded(loaded.logits, memory, split, loaded.hits, second.stats())

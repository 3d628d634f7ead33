"""Canonical KV-cache tensors from raw per-layer caches, the way vLLM builds them.

An attention backend stores a layer either as ``(num_blocks, ...)`` (one canonical tensor)
or with the K/V dimension first, ``(2, num_blocks, ...)`` as FlashAttention does, which
becomes two canonical tensors (K, then V), each a view of its half. Every canonical tensor is
a ``(num_blocks, page_bytes)`` int8 view of the raw memory: handlers write through it into the
engine's own cache. Used by tests, the transfer benchmark and standalone drivers; the vLLM
integration receives canonical tensors from vLLM instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

__all__ = ["canonicalize"]


def _as_pages(tensor: torch.Tensor) -> torch.Tensor:
    # view, never reshape: a copy would make transfers read and write the wrong memory
    return tensor.view(torch.int8).view(tensor.shape[0], -1)


def canonicalize(
    layers: Sequence[torch.Tensor],
    *,
    kv_first: bool | Sequence[bool] = False,
    groups: Sequence[Sequence[int]] | None = None,
) -> CanonicalKVCaches:
    """The :class:`~kvtier.base.CanonicalKVCaches` of raw per-layer caches.

    ``kv_first`` (one flag, or one per layer): the layer is ``(2, num_blocks, ...)``.
    ``groups[g]`` lists the layers of KV group ``g`` (default: one group of every layer; an
    empty list is a group with no layers). Each ref records the full page as its un-padded
    size. Raises ``RuntimeError`` from ``view`` if a layer's bytes per block are not
    contiguous.
    """
    flags = [kv_first] * len(layers) if isinstance(kv_first, bool) else list(kv_first)
    if len(flags) != len(layers):
        raise ValueError(f"kv_first has {len(flags)} flags for {len(layers)} layers")
    tensors: list[CanonicalKVCacheTensor] = []
    per_layer: list[list[int]] = []
    for layer, first in zip(layers, flags):
        halves = (layer[0], layer[1]) if first else (layer,)
        indices = []
        for half in halves:
            pages = _as_pages(half)
            indices.append(len(tensors))
            tensors.append(CanonicalKVCacheTensor(pages, pages.shape[1]))
        per_layer.append(indices)
    if groups is None:
        groups = [list(range(len(layers)))]
    refs = [
        [CanonicalKVCacheRef(t, tensors[t].page_size_bytes) for layer in group for t in per_layer[layer]]
        for group in groups
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)

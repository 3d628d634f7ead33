"""Prefix-aware: the engine already holding the longest prefix of the request, within a load bound.

Each request goes to the engine whose held prefix (:meth:`~kvtier.routing.index.PrefixIndex.score`:
leading blocks held, each weighted by its fastest medium's speed) is longest, among the
engines whose load stays within ``balance`` times the mean once the request is counted,
rounded up (as in consistent hashing with bounded loads: affinity wins until an engine is
``balance`` x busier than average, then the next best takes the request). Among equal scores,
and when no engine holds anything, the least loaded wins, ties rotating.

A score minus a load penalty (Dynamo's KV router weighs both in one cost) was the other
shape: see docs/design/routing.md#a-bound-on-load-not-a-penalty-in-the-score.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvtier.routing.base import DEFAULT_WINDOW_S, Router
from kvtier.routing.index import DEFAULT_MAX_BLOCKS, DEFAULT_SHARED_MEDIA, PrefixIndex
from kvtier.routing.least_loaded import least_loaded

__all__ = ["DEFAULT_BALANCE", "PrefixRouter"]

#: the most an engine's load may exceed the mean load before affinity stops sending it more
DEFAULT_BALANCE = 1.2


class PrefixRouter(Router):
    """Longest held prefix, bounded by load (see the module docstring). ``weights``, ``shared``
    and ``max_blocks`` shape its :class:`~kvtier.routing.index.PrefixIndex`."""

    name = "prefix"

    def __init__(
        self,
        engines: int,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        balance: float = DEFAULT_BALANCE,
        weights: Mapping[str, float] | None = None,
        shared: Iterable[str] = DEFAULT_SHARED_MEDIA,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ):
        super().__init__(engines, window_s=window_s)
        if not balance >= 1:
            raise ValueError(f"balance must be at least 1 (the mean load), got {balance}")
        self.balance = balance
        self.index = PrefixIndex(engines, weights=weights, shared=shared, max_blocks=max_blocks)
        self._last = -1

    def choose(self, block_hashes: Sequence[Hashable], loads: list[int]) -> int:
        assert self.index is not None
        scores = self.index.score(block_hashes)
        # the bounded-loads capacity, rounded up: the least loaded engine always fits in it
        # (its load is at most the mean's floor), and one request never breaks it alone
        bound = math.ceil(self.balance * (sum(loads) + 1) / self.engines)
        eligible = [engine for engine, load in enumerate(loads) if load + 1 <= bound]
        best = max(scores[engine] for engine in eligible)
        if best > 0:
            eligible = [engine for engine in eligible if scores[engine] == best]
        self._last = least_loaded(loads, self._last, eligible)
        return self._last

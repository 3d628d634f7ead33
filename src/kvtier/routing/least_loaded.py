"""Least loaded: the engine with the fewest recent requests, blind to prefixes."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtier.routing.base import Router

__all__ = ["LeastLoadedRouter"]


class LeastLoadedRouter(Router):
    """Sends each request to the engine with the lowest load (see :mod:`kvtier.routing.base`);
    among equals, the first after the engine chosen last, so ties rotate rather than pile on
    engine 0."""

    name = "least_loaded"

    def __init__(self, engines: int, **options: float):
        super().__init__(engines, **options)
        self._last = -1

    def choose(self, block_hashes: Sequence[Hashable], loads: list[int]) -> int:
        self._last = least_loaded(loads, self._last)
        return self._last


def least_loaded(loads: Sequence[float], after: int, among: Sequence[int] | None = None) -> int:
    """The engine of ``among`` (default: all) with the lowest load, ties going to the first
    after engine ``after`` in turn."""
    count = len(loads)
    candidates = range(count) if among is None else among
    return min(candidates, key=lambda engine: (loads[engine], (engine - after - 1) % count))

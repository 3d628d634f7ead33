"""Round-robin: request ``i`` to engine ``i mod N``, blind to prefixes and load (the baseline)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtier.routing.base import Router

__all__ = ["RoundRobinRouter"]


class RoundRobinRouter(Router):
    """Deals requests in turn, as a load balancer that knows nothing of them does."""

    name = "round_robin"

    def choose(self, block_hashes: Sequence[Hashable], loads: list[int]) -> int:
        return sum(self.sent) % self.engines  # the requests sent so far, mod N

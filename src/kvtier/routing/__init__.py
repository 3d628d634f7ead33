"""Prefix-aware routing for a fleet of engines: an index of who holds which blocks, and routers.

A router in front of several engines (a proxy, or ``kvtier replay --engines N --router``)
keeps a :class:`PrefixIndex` fed by the engines' KV events (vLLM's, kvtier's own) and sends
each request to the engine already holding its prefix, bounded by load. ``ROUTERS`` maps the
names ``round_robin``, ``least_loaded`` and ``prefix`` to their classes.
"""

from __future__ import annotations

from kvtier.registry import Registry
from kvtier.routing.base import DEFAULT_WINDOW_S, EngineLoad, Router
from kvtier.routing.events import BlockEvent, batch_events, block_events
from kvtier.routing.index import DEFAULT_MEDIUM_WEIGHTS, PrefixIndex
from kvtier.routing.least_loaded import LeastLoadedRouter
from kvtier.routing.prefix import PrefixRouter
from kvtier.routing.round_robin import RoundRobinRouter

__all__ = [
    "DEFAULT_MEDIUM_WEIGHTS",
    "DEFAULT_WINDOW_S",
    "ROUTERS",
    "BlockEvent",
    "EngineLoad",
    "LeastLoadedRouter",
    "PrefixIndex",
    "PrefixRouter",
    "RoundRobinRouter",
    "Router",
    "batch_events",
    "block_events",
]

#: router name -> "module:Class" (``kvtier replay --router NAME``)
ROUTERS: Registry[Router] = Registry(
    "router",
    Router,
    {
        "round_robin": "kvtier.routing.round_robin:RoundRobinRouter",
        "least_loaded": "kvtier.routing.least_loaded:LeastLoadedRouter",
        "prefix": "kvtier.routing.prefix:PrefixRouter",
    },
    module_key="module_path",
)

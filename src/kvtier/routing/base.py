"""The router contract: pick an engine for each request; and the load every router can see.

**Load** is how many requests the router sent an engine within the last ``window_s`` seconds
of its clock: the ``now_s`` each :meth:`Router.route` call passes (the replay passes the
trace's arrival times; a live router, ``time.monotonic()``). A router sees what it sent
without asking the engines, and with requests that take about ``window_s`` each it is the
count in flight; it is blind to one request being longer than another.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import ClassVar

from kvtier.routing.events import block_events
from kvtier.routing.index import PrefixIndex

__all__ = ["DEFAULT_WINDOW_S", "EngineLoad", "Router"]

#: seconds over which a router counts the requests it sent each engine (its load)
DEFAULT_WINDOW_S = 10.0


class EngineLoad:
    """Per engine, the requests sent within the last ``window_s`` seconds (see the module
    docstring). Times must not go back; each call costs O(1) amortised."""

    def __init__(self, engines: int, window_s: float = DEFAULT_WINDOW_S):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._sent: list[deque[float]] = [deque() for _ in range(engines)]

    def add(self, engine: int, now_s: float) -> None:
        """One request sent to ``engine`` at ``now_s``."""
        self._sent[engine].append(now_s)

    def counts(self, now_s: float) -> list[int]:
        """Each engine's load at ``now_s``."""
        oldest = now_s - self.window_s
        for sent in self._sent:
            while sent and sent[0] <= oldest:
                sent.popleft()
        return [len(sent) for sent in self._sent]


class Router(ABC):
    """Chooses which of ``engines`` engines serves each request.

    Who calls it: the router's one thread (a proxy in front of the engines, or the replay's
    dispatcher), which passes each request's block hashes in prefix order, hashed the way the
    engines publish them (see :mod:`kvtier.routing.events`), and feeds each engine's KV events
    to :meth:`feed` as they come. Nothing here blocks or does I/O.

    A subclass implements :meth:`choose`; the load count and the event plumbing are here. A
    router that reads no events leaves :attr:`index` None, and :meth:`feed` ignores them.
    """

    #: the name ``kvtier replay --router`` knows it by
    name: ClassVar[str]

    def __init__(self, engines: int, *, window_s: float = DEFAULT_WINDOW_S):
        if engines < 1:
            raise ValueError(f"a fleet has at least one engine, got engines={engines}")
        self.engines = engines
        self.load = EngineLoad(engines, window_s)
        #: the prefix index this router scores from, if it reads events
        self.index: PrefixIndex | None = None
        #: the requests sent to each engine since the start
        self.sent = [0] * engines

    def route(self, block_hashes: Sequence[Hashable], now_s: float | None = None) -> int:
        """The engine for a request of ``block_hashes`` arriving at ``now_s`` (default: now)."""
        now_s = time.monotonic() if now_s is None else now_s
        engine = self.choose(block_hashes, self.load.counts(now_s))
        self.load.add(engine, now_s)
        self.sent[engine] += 1
        return engine

    @abstractmethod
    def choose(self, block_hashes: Sequence[Hashable], loads: list[int]) -> int:
        """The engine for the request, given each engine's load (see the module docstring)."""

    def feed(self, engine: int, events: Iterable[object]) -> None:
        """``engine``'s KV events, in its order (any shape :func:`~kvtier.routing.events.block_events`
        reads). A router without an index ignores them."""
        if self.index is not None:
            self.index.apply(engine, (found for event in events for found in block_events(event)))

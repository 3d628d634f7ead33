"""A cluster's nodes as one valkey tier sees them: which failed lately, and when to read the
slot map again.

A node that failed a round trip (refused, timed out, closed) is *down*: the keys of its
slots fail at once, without a round trip, so a stalled node costs one ``timeout_s`` rather
than one per batch, and one dead node never makes the whole tier unreachable. While a node
is down, and after a MOVED reply, the slot map is due to be read again, at pauses doubling
from :data:`REFRESH_FIRST_S` to :data:`REFRESH_MAX_S`. A read that finds the node's slots
served by another (its replica promoted, its slots moved) ends the node's outage; so does a
PING it answers.

Any thread: the worker threads mark nodes down and count redirects, the scheduler thread
asks which nodes are down and whether a read is due, the tier's background thread reads the
map. Changes are made under :attr:`ClusterHealth.lock`; :meth:`ClusterHealth.down_reason` is
one dict lookup and takes no lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvtier.tiers.jobs import Failure

__all__ = ["REFRESH_FIRST_S", "REFRESH_MAX_S", "ClusterHealth", "NodeOutage"]

#: first and longest pause between reads of the slot map while a node is down: a replica
#: takes over about two cluster-node-timeouts after its primary fell silent, and the first
#: read after that ends the outage of the slots
REFRESH_FIRST_S = 0.05
REFRESH_MAX_S = 1.0


@dataclass(frozen=True)
class NodeOutage:
    """A node that failed: why (the first failure), and since when (monotonic)."""

    reason: Failure
    since: float


class ClusterHealth:
    """The down nodes of one tier's cluster and the slot map's schedule (module docstring).

    :attr:`counters` (in the tier's stats): ``node_outages`` is raised as a node goes down,
    ``redirects_moved`` and ``redirects_ask`` with each key followed to another node,
    ``redirects_exhausted`` with each key that failed because it was still redirected after
    the most redirects a batch follows, ``keys_unrouted`` with each key failed because the
    slot map named no node for it (or could not be read), ``slot_map_reads`` with each read
    of the map.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(
            (
                "node_outages",
                "redirects_moved",
                "redirects_ask",
                "redirects_exhausted",
                "keys_unrouted",
                "slot_map_reads",
            ),
            0,
        )
        #: node name (host:port) -> its outage; replaced, never changed in place
        self._down: dict[str, NodeOutage] = {}
        self._due_at: float | None = None  # when the map is read next (None: not due)
        self._backoff_s = REFRESH_FIRST_S
        self._reading = False

    def down_reason(self, node: str) -> Failure | None:
        """Why ``node`` is down, or None if it is not."""
        outage = self._down.get(node)
        return outage.reason if outage is not None else None

    @property
    def down_nodes(self) -> dict[str, NodeOutage]:
        """The nodes down now (a copy)."""
        return dict(self._down)

    def failed(self, node: str, reason: Failure) -> bool:
        """``node`` could not be used: whether this began its outage (else one runs)."""
        with self.lock:
            if node in self._down:
                return False
            now = time.monotonic()
            self._down[node] = NodeOutage(reason, now)
            self.counters["node_outages"] += 1
            self._due_at = now  # a replica may have taken over already
            self._backoff_s = REFRESH_FIRST_S
        return True

    def redirected(self, moved: bool, count: int = 1) -> None:
        """``count`` keys were followed to the node a MOVED (else an ASK) named; after a MOVED
        the map is stale, so it is read again at once."""
        with self.lock:
            self.counters["redirects_moved" if moved else "redirects_ask"] += count
            if moved:
                self._due_at = time.monotonic()

    def redirected_too_often(self) -> None:
        """A key was still redirected after the most redirects a batch follows: the nodes
        disagree about its slot, so the map is read again at once."""
        with self.lock:
            self.counters["redirects_exhausted"] += 1
            self._due_at = time.monotonic()

    def unrouted(self, count: int) -> None:
        """``count`` keys failed because the slot map named no node for them, or could not be
        read: the map is read again at once."""
        with self.lock:
            self.counters["keys_unrouted"] += count
            self._due_at = time.monotonic()

    def read_due(self) -> bool:
        """Whether the slot map should be read now (none being read, its pause over); if so,
        a read is deemed running until :meth:`read_done`."""
        with self.lock:
            if self._reading or self._due_at is None or time.monotonic() < self._due_at:
                return False
            self._reading = True
        return True

    def read_done(self, serving: set[str] | None, answered: set[str]) -> list[tuple[str, NodeOutage]]:
        """A read's outcome: ``serving``, the nodes the new map sends keys to (None: it could
        not be read); ``answered``, down nodes that answered a PING. The nodes whose outage
        this ended, each with its outage."""
        with self.lock:
            self._reading = False
            if serving is not None:
                self.counters["slot_map_reads"] += 1
            ended = [
                (node, outage)
                for node, outage in self._down.items()
                if node in answered or (serving is not None and node not in serving)
            ]
            if ended:
                self._down = {node: o for node, o in self._down.items() if node not in dict(ended)}
            if self._down or serving is None:
                self._backoff_s = min(REFRESH_MAX_S, self._backoff_s * 2)
                self._due_at = time.monotonic() + self._backoff_s
            else:
                self._backoff_s = REFRESH_FIRST_S
                self._due_at = None
        return ended

"""Near-miss probes of a shared tier's sibling namespaces: is a missed block there under
another layout, tensor-parallel size or namespace?

Engines that disagree on a layout (another model, dtype, block size or TP size) or on a
configured namespace write the same offload keys under different namespaces, so each sees a
hit ratio of 0% and nothing looks wrong. Each unkeyed tier publishes its namespace and layout
in one hash (``kvtier-layouts``: namespace -> JSON of the layout's fields) with its first
probe (a tier only ever read or written directly, as tools do, adds no key); a lookup that
misses as ``new`` may ask, at most :data:`KEYS_PER_STEP` keys a step and one
batch at a time, whether up to :data:`MAX_SIBLINGS` other namespaces hold the same key
(pipelined ``EXISTS``), and the manager moves such a miss from ``new`` to ``foreign``, naming
the part that differs (:func:`differing_part`).

Tiers with a secret neither publish nor probe: their names are keyed digests another engine
cannot compute, and publishing their layout would tell others which model is cached. A
block under another secret can only be told by reading it (see :mod:`kvtier.manager.causes`).

Threads: :class:`SiblingProbe`'s ``want`` and ``send`` run on the scheduler thread; its
``_run`` on the tier's reader thread; results pass through a deque.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable

from kvtier.base import OffloadKey
from kvtier.tiers.disk.format import LayoutFingerprint, differing_part

__all__ = ["KEYS_PER_STEP", "LAYOUTS_NAME", "MAX_SIBLINGS", "SiblingProbe", "differing_part"]

logger = logging.getLogger(__name__)

#: the hash every unkeyed tier publishes its namespace and layout in (outside ``kvtier:*``,
#: which ``kvtier check`` scans as namespaces of blocks)
LAYOUTS_NAME = b"kvtier-layouts"
#: the most missed keys probed per scheduler step
KEYS_PER_STEP = 4
#: the most other namespaces asked about a key
MAX_SIBLINGS = 4
#: the most keys waiting for a probe (more are dropped: a probe is a diagnosis, not a duty)
MAX_WAITING = 64
#: how long the list of siblings is reused before it is read again
SIBLINGS_TTL_S = 10.0


class SiblingProbe:
    """A bounded, rate-limited probe of the sibling namespaces on one server.

    ``client``: a callable returning the ``valkey`` client (connects lazily); ``namespace``
    and ``fingerprint``: this tier's.
    """

    def __init__(self, client: Callable, namespace: str, fingerprint: LayoutFingerprint):
        self._client = client
        self.namespace = namespace
        self._own = fingerprint.to_dict()
        self._waiting: dict[OffloadKey, None] = {}
        self._in_flight = False
        self._found: deque[tuple[OffloadKey, str]] = deque()
        self._siblings: list[tuple[str, str]] = []  # (namespace, part), read on the reader thread
        self._siblings_at = -SIBLINGS_TTL_S
        self._published = False
        #: keys probed, and those found under a sibling (the tier's stats)
        self.probed = 0
        self.found = 0

    def _publish(self) -> None:
        """Say this namespace holds this layout, once (reader thread; a failure, an ACL's
        NOPERM say, is only logged, and tried again with the next probe)."""
        try:
            self._client().hset(LAYOUTS_NAME, self.namespace, json.dumps(self._own, sort_keys=True))
            self._published = True
        except Exception as error:  # the probe of the others still works
            logger.debug("kvtier: publishing layout of %s failed: %s", self.namespace, error)

    def want(self, key: OffloadKey) -> None:
        """``key`` missed as new: probe it soon, if there is room (scheduler thread)."""
        if len(self._waiting) < MAX_WAITING:
            self._waiting[key] = None

    def send(self, submit: Callable) -> None:
        """At the step's end: submit up to :data:`KEYS_PER_STEP` waiting keys as one batch
        through ``submit(fn, *args)``, unless one is in flight (scheduler thread)."""
        if self._in_flight or not self._waiting:
            return
        keys = list(self._waiting)[:KEYS_PER_STEP]
        for key in keys:
            del self._waiting[key]
        self._in_flight = True
        submit(self._run, keys)

    def take_found(self) -> list[tuple[OffloadKey, str]]:
        """``(key, part)`` for each probed key found under a sibling, since the last call."""
        found = []
        while self._found:
            found.append(self._found.popleft())
        return found

    def _run(self, keys: list[OffloadKey]) -> None:
        """Reader thread: ask the siblings about ``keys``; never raises."""
        if not self._published:
            self._publish()
        try:
            siblings = self._sibling_namespaces()
            if siblings:
                client = self._client()
                pipe = client.pipeline(transaction=False)
                asked = [(key, part) for key in keys for _, part in siblings]
                for key in keys:
                    for namespace, _ in siblings:
                        pipe.exists(f"{namespace}:{key.hex()}".encode())
                answers = pipe.execute()
                seen: set[OffloadKey] = set()
                for (key, part), there in zip(asked, answers):
                    if there and key not in seen:
                        seen.add(key)
                        self._found.append((key, part))
                self.found += len(seen)
            self.probed += len(keys)
        except Exception as error:  # an outage is counted by the tier's own jobs
            logger.debug("kvtier: probing siblings of %s failed: %s", self.namespace, error)
        finally:
            self._in_flight = False

    def _sibling_namespaces(self) -> list[tuple[str, str]]:
        """Up to :data:`MAX_SIBLINGS` other published namespaces and what differs (cached)."""
        now = time.monotonic()
        if now - self._siblings_at < SIBLINGS_TTL_S:
            return self._siblings
        published = self._client().hgetall(LAYOUTS_NAME) or {}
        siblings = []
        for name, text in sorted(published.items()):
            namespace = name.decode() if isinstance(name, bytes) else str(name)
            if namespace == self.namespace:
                continue
            try:
                layout = json.loads(text)
            except ValueError:
                continue  # not ours to judge: someone else's field
            if isinstance(layout, dict):
                siblings.append((namespace, differing_part(self._own, layout)))
        self._siblings = siblings[:MAX_SIBLINGS]
        self._siblings_at = now
        return self._siblings

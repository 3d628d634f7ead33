"""The valkey tier's outage state: whether the server is away, since when, why, and when to
ping it again.

Shared by the scheduler thread and the worker threads, so every change is made under
:attr:`Outage.lock`. The tier decides what an outage means for lookups and jobs and logs it;
this holds the state and its transitions only.
"""

from __future__ import annotations

import threading
import time

from kvtier.tiers.jobs import Failure

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Outage"]

#: first and longest pause between reconnect attempts during an outage
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 5.0


class Outage:
    """An outage's state; ``counters["outages"]`` is raised as one begins. Any thread."""

    def __init__(self, counters: dict[str, int]):
        self.lock = threading.Lock()
        self._counters = counters
        #: when the outage began (None: the server answers); guarded by ``lock``
        self.since: float | None = None
        #: why (the first failure that began it)
        self.reason: Failure | None = None
        self._warned: set[str] = set()  # reasons (denied commands ...) warned about once
        self._total_s = 0.0
        self._backoff_s = BACKOFF_FIRST_S
        self._next_ping = 0.0
        self._pinging = False

    @property
    def down(self) -> bool:
        return self.since is not None

    def begin(self, reason: Failure) -> bool:
        """The server could not be reached: whether this began an outage (else one runs)."""
        with self.lock:
            if self.since is not None:
                return False
            now = time.monotonic()
            self.since = now
            self.reason = reason
            self._backoff_s = BACKOFF_FIRST_S
            self._next_ping = now + BACKOFF_FIRST_S
            self._counters["outages"] += 1
        return True

    def first_warning(self, tag: str) -> bool:
        """Whether ``tag`` (a reason's text) is seen for the first time: warn about it once."""
        with self.lock:
            if tag in self._warned:
                return False
            self._warned.add(tag)
        return True

    def ping_due(self) -> bool:
        """Whether a reconnect attempt should start now (none running, its pause over); if so,
        one is deemed running until :meth:`ping_done`."""
        with self.lock:
            if self._pinging or time.monotonic() < self._next_ping:
                return False
            self._pinging = True
        return True

    def ping_done(self, ok: bool) -> float | None:
        """A reconnect attempt's outcome: how long the outage lasted if this ended it, else None."""
        with self.lock:
            self._pinging = False
            if self.since is None:
                return None
            now = time.monotonic()
            if not ok:
                self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)
                self._next_ping = now + self._backoff_s
                return None
            lasted = now - self.since
            self._total_s += lasted
            self.since = None
        return lasted

    def seconds(self) -> float:
        """Time spent in outages so far, the current one included."""
        with self.lock:
            total = self._total_s
            if self.since is not None:
                total += time.monotonic() - self.since
        return total

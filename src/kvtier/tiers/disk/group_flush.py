"""Group commit of a filesystem flush, shared by the threads that ask while one runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["GroupFlush"]

#: how often a gathering flush looks again whether the tier is still busy
_GATHER_POLL_S = 0.002
#: how many flushes back an error stays known to the callers a flush served
_ERRORS_KEPT = 64


class GroupFlush:
    """Group commit of ``syncfs``: a caller returns once a flush that *started after it asked*
    has finished, and callers that ask while one runs share the next one.

    Why: each syncfs commits the filesystem's journal, and while a commit runs, every file
    creation and rename of the tier's I/O threads waits for it
    (docs/design/disk.md#where-the-files-tiers-write-time-went). Jobs that finish while a
    flush runs need the same work done once more, not once each.
    Correct because a flush that starts after a job's blocks are written and published
    covers them. Any thread; blocks the caller for up to two flushes.

    Gathering: while ``busy()`` says more blocks wait for the tier's threads, a flush about to
    start waits for them, up to ``gather_s``; callers asking meanwhile share it (it has not
    begun yet). Each flush makes the file system write the metadata its files dirtied since
    the last one, so a busy tier flushing less often writes less of it again
    (docs/design/disk.md#filling-a-store); an idle one flushes at once.
    """

    def __init__(
        self, flush: Callable[[], None], busy: Callable[[], bool] | None = None, gather_s: float = 0.0
    ):
        self._flush = flush
        self._busy = busy
        self._gather_s = gather_s
        self._cond = threading.Condition(threading.Lock())
        self._started = 0  # flushes begun
        self._finished = 0  # flushes ended
        self._running = False
        self._errors: dict[int, OSError] = {}  # flush number -> its error, while anyone may ask

    def ticket(self) -> int:
        """The flushes begun so far: read after the caller's data is written and published,
        any flush numbered above it covers that data (see :meth:`flush`). No lock: the count
        only grows, and is raised before its flush's system call."""
        return self._started

    def flush(self, after: int | None = None) -> None:
        """Return once a flush begun after :meth:`ticket` returned ``after`` (default: after
        this call) has ended; raise its OSError if it failed.

        A job passes the highest ticket its blocks took as each was published: a flush that
        began after the last of them covers the job, even if it began before the job asked,
        so jobs finishing behind a flush do not each ask for another."""
        with self._cond:
            # a flush running now may have started before our blocks were published: only
            # one begun after counts
            needed = (self._started if after is None else after) + 1
            if needed < self._finished - _ERRORS_KEPT:  # its outcome may be forgotten
                needed = self._started + 1
            while self._finished < needed:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True  # from here, later callers wait for this flush
                self._gather()
                self._started += 1
                number = self._started
                self._cond.release()
                error = None
                try:
                    self._flush()
                except OSError as exc:
                    error = exc
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._finished = number
                    if error is not None:
                        self._errors[number] = error
                    # errors older than a few flushes can no longer be asked for
                    for old in [n for n in self._errors if n < number - _ERRORS_KEPT]:
                        del self._errors[old]
                    self._cond.notify_all()
            # flushes run one at a time and are numbered in order, so flush `needed` is the
            # first one begun after we asked: its outcome is ours
            error = self._errors.get(needed)
        if error is not None:
            raise error

    def _gather(self) -> None:
        """Hold the flush about to start while the tier is busy, up to ``gather_s`` (lock held;
        the waits release it, so that callers can join)."""
        busy = self._busy
        if busy is None or self._gather_s <= 0:
            return
        deadline = time.monotonic() + self._gather_s
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(left, _GATHER_POLL_S))

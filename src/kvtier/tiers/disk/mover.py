"""The disk tiers' mover: background threads that copy blocks between CPU rows and a disk.

A tier hands the mover a :class:`MoverJob` (one job's keys and CPU rows, plus what to do per
block) and returns at once; the mover's threads run it and queue the finished job, which the
tier collects with :meth:`Mover.poll` on the scheduler thread. Nothing here ever runs on the
caller's thread.

Four kinds of thread, all daemons, all started by :class:`Mover`:

* **I/O threads** (``threads`` of them) run one block at a time — a ``pwritev``/``preadv`` of
  ``[header page, CPU row]`` — taking loads before stores (a load is on a request's critical
  path, a store is not), so a burst of demotions never delays a promotion.
* **the sequencer** (one) runs each store job's *prologue* — the index work that must happen
  in submission order (evicting victims, reserving room) — and then releases the job's blocks
  to the I/O threads. Order matters because job 1 may evict a key that job 2 stores again:
  done out of order, job 2 would find the key "already present" and job 1 would then delete it.
* **finishers** (``finishers`` of them) run each job's *epilogue* (fsync, commit the index)
  once its last block is done, so the I/O threads go straight back to blocks while a flush
  runs (docs/design/disk.md#where-the-files-tiers-write-time-went).

Blocks of one job run in parallel on all I/O threads (a job of 16 blocks uses every thread),
so a single large batch per scheduler step still reaches the disk's throughput. Sixteen
threads by default: each block also costs its thread some CPU with no I/O in flight, and 16
reached the raw disk rate where 4 and 8 did not (docs/design/disk.md#sixteen-io-threads).

Block I/O itself (buffers, O_DIRECT, one block's write and read) is in
:mod:`kvtier.tiers.disk.blockio`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvtier.tiers.base import Failure, FailureKind, TierWork

__all__ = ["DEFAULT_THREADS", "Mover", "MoverJob"]

logger = logging.getLogger(__name__)

#: I/O threads per tier unless told otherwise (see the module docstring for the measurement)
DEFAULT_THREADS = 16
#: threads running epilogues (the flush and index commit of a store job), so that an I/O
#: thread never waits for a flush; several, so that jobs finishing together can share one
#: (the files tier's group syncfs)
DEFAULT_FINISHERS = 4

#: the medium's own per-job notes (a dataclass of the medium's), between its three steps
S = TypeVar("S")


# ---------------------------------------------------------------------------------------------
# Jobs and the thread pool


@dataclass(eq=False)
class MoverJob(TierWork, Generic[S]):
    """One tier job as the mover runs it: per-key work plus an optional prologue and epilogue.

    ``block(job, i)`` moves key ``i`` and returns ``None`` or a :class:`Failure`; it runs on
    an I/O thread. ``before(job)`` (store jobs) runs on the sequencer in submission order
    before any block; it may fail keys (``reasons[i] = Failure.FULL``) or mark them done
    without I/O (``skip[i] = True``, e.g. already on disk). ``after(job)`` runs once after
    the last block, on a finisher thread; it may fail keys too (a failed commit fails them
    all). ``block_ids``, ``shared_units`` and ``refused`` (from :class:`TierWork`) carry the
    medium's results back to the tier; ``state`` is the medium's own typed notes between the
    three steps (``MoverJob[_FilesStoreState]`` ...).

    Only the mover's threads touch a job between :meth:`Mover.submit` and :meth:`Mover.poll`.
    """

    block: Callable[[MoverJob[S], int], Failure | None] = field(kw_only=True)
    before: Callable[[MoverJob[S]], None] | None = field(default=None, kw_only=True)
    after: Callable[[MoverJob[S]], None] | None = field(default=None, kw_only=True)
    #: per key: settled by the prologue without block I/O
    skip: list[bool] = field(default_factory=list, kw_only=True)
    #: the medium's notes between its prologue, blocks and epilogue
    state: S | None = field(default=None, kw_only=True)
    submitted_s: float = field(default_factory=time.perf_counter, kw_only=True)
    #: submission to completion, set when finished
    seconds: float = field(default=0.0, kw_only=True)
    _remaining: int = field(default=0, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.skip:
            self.skip = [False] * len(self.keys)


class Mover:
    """The I/O threads, sequencer and completion queue of one disk tier.

    :meth:`submit`, :meth:`poll`, :meth:`pending` are for the tier's scheduler thread and never
    block on I/O (they hold the queue lock for a few list operations). :meth:`wait_idle`,
    :meth:`wait_loads` and :meth:`close` block. A job's ``block``/``before``/``after`` callables run on the mover's
    threads and must not raise for expected failures (they return reasons); an unexpected
    exception fails the keys concerned with ``Failure(UNEXPECTED)`` and is logged with its traceback.
    """

    def __init__(self, name: str, threads: int = DEFAULT_THREADS, finishers: int = DEFAULT_FINISHERS):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.name = name
        self.threads = threads
        # One lock, a condition per kind of waiter: a block queued wakes an I/O thread, not
        # the finishers and waiters too (with one condition every notify woke all of them,
        # 20 threads a job taking the GIL in turn only to sleep again).
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the caller's waits: idle, loads done
        self._blocks_ready = threading.Condition(lock)  # I/O threads
        self._sequenced_ready = threading.Condition(lock)  # the sequencer
        self._epilogues_ready = threading.Condition(lock)  # finishers
        self._loads: deque[tuple[MoverJob, int]] = deque()
        self._stores: deque[tuple[MoverJob, int]] = deque()
        self._sequenced: deque[MoverJob | Callable[[], None]] = deque()
        self._finished: deque[MoverJob] = deque()  # appended by mover threads, popped by poll
        self._epilogues: deque[MoverJob] = deque()  # jobs whose last block is done
        self._inflight = 0  # submitted and not yet in _finished (guarded by _cond)
        self._loads_inflight = 0  # the load jobs among them (guarded by _cond)
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"kvtier-{name}-io{i}", daemon=True)
            for i in range(threads)
        ]
        self._sequencer = threading.Thread(target=self._sequence, name=f"kvtier-{name}-seq", daemon=True)
        self._finishers = [
            threading.Thread(target=self._run_epilogues, name=f"kvtier-{name}-fin{i}", daemon=True)
            for i in range(finishers)
        ]
        for thread in (*self._workers, self._sequencer, *self._finishers):
            thread.start()

    # -- the tier's side ------------------------------------------------------------------------

    def submit(self, job: MoverJob) -> None:
        """Queue ``job``: through the sequencer if it has a prologue, else straight to the I/O threads."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"mover {self.name} is closed")
            self._inflight += 1
            if job.is_load:
                self._loads_inflight += 1
            if job.before is not None:
                self._sequenced.append(job)
                self._sequenced_ready.notify()
            else:
                job._remaining = len(job.keys)
                (self._loads if job.is_load else self._stores).extend((job, i) for i in range(len(job.keys)))
                self._blocks_ready.notify(len(job.keys))
        if job.before is None and not job.keys:
            self._finish(job)

    def submit_sequenced(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the sequencer, in order with store prologues (index maintenance)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"mover {self.name} is closed")
            self._inflight += 1
            self._sequenced.append(task)
            self._sequenced_ready.notify()

    def poll(self) -> list[MoverJob]:
        """Jobs finished since the last call, each once; never waits."""
        finished = self._finished
        done = []
        while finished:
            done.append(finished.popleft())
        return done

    def stores_waiting(self) -> bool:
        """Whether store blocks wait for an I/O thread: the tier is behind. Any thread, no lock."""
        return bool(self._stores)

    def pending(self) -> int:
        """Jobs submitted and not finished yet (finished ones may still await :meth:`poll`)."""
        return self._inflight

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is in flight; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout_s)

    def wait_loads(self, timeout_s: float | None = None) -> bool:
        """Block until no load job is in flight (stores may still run); ``False`` on timeout.

        A promotion's reader waits here: the I/O threads take loads first, so this returns
        as soon as the reads are done, not after the stores queued beside them (whose flush
        and index commit can take far longer).
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._loads_inflight == 0, timeout_s)

    def close(self) -> None:
        """Finish everything queued, then stop the threads. Idempotent; blocks."""
        with self._cond:
            if self._closed:
                return
        self.wait_idle()
        with self._cond:
            self._closed = True
            for condition in (self._cond, self._blocks_ready, self._sequenced_ready, self._epilogues_ready):
                condition.notify_all()
        for thread in (*self._workers, self._sequencer, *self._finishers):
            if thread is not threading.current_thread():
                thread.join()

    # -- the mover's threads --------------------------------------------------------------------

    def _work(self) -> None:
        cond = self._blocks_ready
        while True:
            with cond:
                while not (self._loads or self._stores or self._closed):
                    cond.wait()
                if self._loads:
                    job, index = self._loads.popleft()
                elif self._stores:
                    job, index = self._stores.popleft()
                else:
                    return
            try:
                reason = job.block(job, index)
            except BaseException as exc:  # noqa: BLE001 - a bug in a tier must not kill the thread
                reason = self._unexpected(exc, "block")
            job.reasons[index] = reason
            with cond:
                job._remaining -= 1
                last = job._remaining == 0
            if last:
                self._finish(job)

    def _sequence(self) -> None:
        cond = self._sequenced_ready
        while True:
            with cond:
                while not (self._sequenced or self._closed):
                    cond.wait()
                if not self._sequenced:
                    return
                item = self._sequenced.popleft()
            if not isinstance(item, MoverJob):
                try:
                    item()
                except BaseException as exc:  # noqa: BLE001 - logged; the sequencer goes on
                    self._unexpected(exc, "maintenance")
                with cond:
                    self._inflight -= 1
                    self._cond.notify_all()
                continue
            job = item
            try:
                job.before(job)  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - fails this job's keys only
                reason = self._unexpected(exc, "prologue")
                job.reasons = [reason] * len(job.keys)
            todo = [i for i in range(len(job.keys)) if not job.skip[i] and job.reasons[i] is None]
            if not todo:
                self._finish(job)
                continue
            with cond:
                job._remaining = len(todo)
                (self._loads if job.is_load else self._stores).extend((job, i) for i in todo)
                self._blocks_ready.notify(len(todo))

    def _finish(self, job: MoverJob) -> None:
        """The job's last block is done: its epilogue goes to a finisher thread (an I/O thread
        goes back to blocks at once), or, without one, the job is finished here."""
        if job.after is None:
            self._complete(job)
            return
        with self._cond:
            self._epilogues.append(job)
            self._epilogues_ready.notify()

    def _run_epilogues(self) -> None:
        cond = self._epilogues_ready
        while True:
            with cond:
                while not (self._epilogues or self._closed):
                    cond.wait()
                if not self._epilogues:
                    return
                job = self._epilogues.popleft()
            try:
                job.after(job)  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - fails this job's keys only
                reason = self._unexpected(exc, "epilogue")
                job.reasons = [r if r is not None else reason for r in job.reasons]
            self._complete(job)

    def _complete(self, job: MoverJob) -> None:
        job.seconds = time.perf_counter() - job.submitted_s
        self._finished.append(job)
        with self._cond:
            self._inflight -= 1
            if job.is_load:
                self._loads_inflight -= 1
            self._cond.notify_all()

    def _unexpected(self, exc: BaseException, where: str) -> Failure:
        logger.error("kvtier tier %s: unexpected error in a job's %s", self.name, where, exc_info=exc)
        return Failure(FailureKind.UNEXPECTED, detail=type(exc).__name__)

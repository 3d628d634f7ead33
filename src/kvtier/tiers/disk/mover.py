"""The disk tiers' mover: background threads that copy blocks between CPU rows and a disk.

A tier hands the mover a :class:`MoverJob` (one job's keys and CPU rows, plus what to do per
block) and returns at once; the mover's threads run it and queue the finished job, which the
tier collects with :meth:`Mover.poll` on the scheduler thread. Nothing here ever runs on the
caller's thread.

Three kinds of thread, all daemons, all started by :class:`Mover`:

* **I/O threads** (``threads`` of them) run one block at a time — a ``pwritev``/``preadv`` of
  ``[header page, CPU row]`` — taking loads before stores (a load is on a request's critical
  path, a store is not), so a burst of demotions never delays a promotion.
* **the sequencer** (one) runs each store job's *prologue* — the index work that must happen
  in submission order (evicting victims, reserving room) — and then releases the job's blocks
  to the I/O threads. Order matters because job 1 may evict a key that job 2 stores again:
  done out of order, job 2 would find the key "already present" and job 1 would then delete it.
* the thread that finishes a job's last block runs its *epilogue* (fsync, commit the index).

Blocks of one job run in parallel on all I/O threads (a job of 16 blocks uses every thread),
so a single large batch per scheduler step still reaches the disk's throughput. The default
thread count was measured on the reference machine (2 vCPU, virtio disk, 2 MiB blocks, 4
interleaved rounds against raw O_DIRECT I/O with as many threads): the disk itself is at its
limit with 2 threads, but each block also costs its thread ~0.15-0.3 ms of CPU (the xxh3
checksum, the header, the index), during which that thread has no I/O in flight. With 4
threads the tiers reached 0.81-0.82 of the raw write rate, with 8 0.90-0.98, with 16 0.94-0.96
(reads 0.88-0.95, ~1.0, ~1.0). Sixteen threads cost little — they sleep in system calls — and
match vLLM's fs tier (16 per direction).

Also here: the O_DIRECT probe (once per directory, cached), page-aligned scratch buffers, and
:class:`RowIO`, which turns CPU rows into I/O vectors.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.base import OffloadKey
from kvtier.tiers.disk.format import PAGE_BYTES, padded_payload_bytes

__all__ = [
    "DEFAULT_THREADS",
    "O_DIRECT",
    "Mover",
    "MoverJob",
    "ODirectProbe",
    "RowIO",
    "aligned_buffer",
    "errno_reason",
    "probe_o_direct",
    "scratch_page",
]

logger = logging.getLogger(__name__)

#: I/O threads per tier unless told otherwise (see the module docstring for the measurement)
DEFAULT_THREADS = 16
#: ``os.O_DIRECT`` where the platform has it, else 0
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to pages) of zeroed, page-aligned memory: an O_DIRECT buffer.

    An anonymous mapping always starts on a page boundary, which a ``bytearray`` does not.
    """
    return mmap.mmap(-1, max(PAGE_BYTES, padded_payload_bytes(nbytes)))


_thread_pages = threading.local()


def scratch_page() -> mmap.mmap:
    """This thread's own page-aligned 4096-byte buffer (for block headers); made once per thread."""
    page = getattr(_thread_pages, "page", None)
    if page is None:
        page = _thread_pages.page = aligned_buffer(PAGE_BYTES)
    return page


def errno_reason(exc: BaseException) -> str:
    """A short failure reason for a job result: the errno's name (``ENOSPC``), else the type."""
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return type(exc).__name__


# ---------------------------------------------------------------------------------------------
# O_DIRECT


@dataclass(frozen=True)
class ODirectProbe:
    """Whether O_DIRECT works in a directory, and why not when it does not."""

    supported: bool
    reason: str = ""


_probe_lock = threading.Lock()
_probes: dict[str, ODirectProbe] = {}


def probe_o_direct(directory: str) -> ODirectProbe:
    """Whether an aligned O_DIRECT write and read-back work in ``directory`` (cached per directory).

    Some filesystems refuse O_DIRECT at open (tmpfs before Linux 6.6, overlayfs in some
    containers) and some at the first write (EINVAL); only a real write and read tells. Blocks
    for a few small I/Os the first time for a directory, never afterwards.
    """
    key = os.path.realpath(directory)
    with _probe_lock:
        found = _probes.get(key)
        if found is None:
            found = _probes[key] = _probe(key)
    return found


def _probe(directory: str) -> ODirectProbe:
    if not O_DIRECT:
        return ODirectProbe(False, "this platform has no O_DIRECT")
    path = os.path.join(directory, f".kvtier-odirect-probe-{os.getpid()}-{secrets.token_hex(4)}")
    out = aligned_buffer(PAGE_BYTES)
    back = aligned_buffer(PAGE_BYTES)
    out[:16] = b"kvtier o_direct!"
    step = "open"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            step = "write"
            if os.pwrite(fd, out, 0) != PAGE_BYTES:
                return ODirectProbe(False, "short O_DIRECT write")
            step = "read"
            if os.preadv(fd, [back], 0) != PAGE_BYTES or back[:] != out[:]:
                return ODirectProbe(False, "O_DIRECT read-back differs from what was written")
        finally:
            os.close(fd)
        return ODirectProbe(True)
    except OSError as exc:
        return ODirectProbe(False, f"O_DIRECT {step} fails here: {exc.strerror} ({errno_reason(exc)})")
    finally:
        out.close()
        back.close()
        try:
            os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# CPU rows as I/O vectors


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    try:
        from numpy.lib.array_utils import byte_bounds  # numpy >= 2
    except ImportError:  # numpy 1.x
        byte_bounds = np.byte_bounds  # type: ignore[attr-defined]
    return byte_bounds(array)


class RowIO:
    """The CPU tier's rows as buffers for ``pwritev``/``preadv``; any thread, never blocks.

    With O_DIRECT every buffer address and length must be a multiple of 4096. The CPU tier's
    rows start on pages and are ``row_stride`` (``block_bytes`` rounded up to 4096) apart, and
    the padding after a row's ``block_bytes`` belongs to that row alone, so a row's *padded*
    span is a valid O_DIRECT buffer: a store writes the padding along (a few junk bytes on
    disk, outside the checksum) and a load overwrites it. This relies on the padding of every
    row (the last one included) lying inside the array's memory, which :meth:`direct_problem`
    checks; rows that fail the check get buffered I/O of exactly ``block_bytes``, still straight
    into the row (no staging copy).
    """

    def __init__(self, rows: np.ndarray):
        if rows.ndim != 2 or rows.dtype != np.uint8 or rows.strides[1] != 1:
            raise ValueError(
                f"rows must be a (num_rows, block_bytes) uint8 array with contiguous rows, "
                f"got shape {rows.shape}, dtype {rows.dtype}, strides {rows.strides}"
            )
        self.rows = rows
        self.num_rows, self.block_bytes = rows.shape
        #: bytes an O_DIRECT transfer of one row moves
        self.padded_bytes = padded_payload_bytes(self.block_bytes)
        #: why the rows cannot be O_DIRECT buffers, or None when they can
        self.direct_problem = self._direct_problem()
        self._padded = rows
        if self.direct_problem is None and self.padded_bytes != self.block_bytes:
            self._padded = np.lib.stride_tricks.as_strided(
                rows, shape=(self.num_rows, self.padded_bytes), strides=rows.strides
            )

    def _direct_problem(self) -> str | None:
        address = self.rows.__array_interface__["data"][0]
        stride = self.rows.strides[0]
        if address % PAGE_BYTES:
            return "the CPU rows do not start on a 4096-byte page"
        if self.num_rows > 1 and (stride % PAGE_BYTES or stride < self.padded_bytes):
            return f"the CPU row stride ({stride} bytes) is not a multiple of 4096 covering a row"
        root = self.rows
        while isinstance(root.base, np.ndarray):
            root = root.base
        _, high = _byte_bounds(root)
        if address + (self.num_rows - 1) * stride + self.padded_bytes > high:
            return "the last CPU row has no padding up to a multiple of 4096 bytes"
        if not self.rows.flags.writeable:
            return "the CPU rows are read-only"
        return None

    def payload(self, row: int) -> np.ndarray:
        """Row ``row``'s ``block_bytes`` (what is checksummed)."""
        return self.rows[row]

    def iov(self, row: int, direct: bool) -> np.ndarray:
        """Row ``row`` as an I/O buffer: its padded span for O_DIRECT, else ``block_bytes``."""
        return self._padded[row] if direct else self.rows[row]

    def io_bytes(self, direct: bool) -> int:
        """Length of :meth:`iov`."""
        return self.padded_bytes if direct else self.block_bytes


# ---------------------------------------------------------------------------------------------
# Jobs and the thread pool


class MoverJob:
    """One tier job as the mover runs it: per-key work plus an optional prologue and epilogue.

    ``block(job, i)`` moves key ``i`` and returns ``None`` or a failure reason; it runs on an
    I/O thread. ``before(job)`` (store jobs) runs on the sequencer in submission order before
    any block; it may fail keys (``reasons[i] = "full"``) or mark them done without I/O
    (``skip[i] = True``, e.g. already on disk). ``after(job)`` runs once after the last block,
    on that block's thread; it may fail keys too (a failed commit fails them all).
    ``block_ids[i]`` and ``extra`` carry medium-specific results back to the tier; ``state``
    is the medium's own scratch between the three steps.

    Only the mover's threads touch a job between :meth:`Mover.submit` and :meth:`Mover.poll`.
    """

    __slots__ = (
        "_remaining",
        "after",
        "before",
        "block",
        "block_ids",
        "extra",
        "is_load",
        "job_id",
        "keys",
        "reasons",
        "rows",
        "seconds",
        "skip",
        "state",
        "submitted_s",
    )

    def __init__(
        self,
        job_id: int,
        is_load: bool,
        keys: list[OffloadKey],
        rows: list[int],
        *,
        block: Callable[[MoverJob, int], str | None],
        before: Callable[[MoverJob], None] | None = None,
        after: Callable[[MoverJob], None] | None = None,
    ):
        self.job_id = job_id
        self.is_load = is_load
        self.keys = keys
        self.rows = rows
        self.block = block
        self.before = before
        self.after = after
        #: per key: None (ok) or why it failed
        self.reasons: list[str | None] = [None] * len(keys)
        #: per key: settled by the prologue without block I/O
        self.skip: list[bool] = [False] * len(keys)
        #: per key: where the medium put it (a slot), for the tier's index
        self.block_ids: list[int] = [0] * len(keys)
        #: medium-specific figures for the tier (e.g. blocks on disk, all processes)
        self.extra: dict[str, int] = {}
        #: the medium's own per-job notes, between its prologue, blocks and epilogue
        self.state: object = None
        self.submitted_s = time.perf_counter()
        #: submission to completion, set when finished
        self.seconds = 0.0
        self._remaining = 0


class Mover:
    """The I/O threads, sequencer and completion queue of one disk tier.

    :meth:`submit`, :meth:`poll`, :meth:`pending` are for the tier's scheduler thread and never
    block on I/O (they hold the queue lock for a few list operations). :meth:`wait_idle` and
    :meth:`close` block. A job's ``block``/``before``/``after`` callables run on the mover's
    threads and must not raise for expected failures (they return reasons); an unexpected
    exception fails the keys concerned with ``error: <type>`` and is logged with its traceback.
    """

    def __init__(self, name: str, threads: int = DEFAULT_THREADS):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.name = name
        self.threads = threads
        self._cond = threading.Condition(threading.Lock())
        self._loads: deque[tuple[MoverJob, int]] = deque()
        self._stores: deque[tuple[MoverJob, int]] = deque()
        self._sequenced: deque[MoverJob | Callable[[], None]] = deque()
        self._finished: deque[MoverJob] = deque()  # appended by mover threads, popped by poll
        self._inflight = 0  # submitted and not yet in _finished (guarded by _cond)
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"kvtier-{name}-io{i}", daemon=True)
            for i in range(threads)
        ]
        self._sequencer = threading.Thread(
            target=self._sequence, name=f"kvtier-{name}-seq", daemon=True
        )
        for thread in (*self._workers, self._sequencer):
            thread.start()

    # -- the tier's side ------------------------------------------------------------------------

    def submit(self, job: MoverJob) -> None:
        """Queue ``job``: through the sequencer if it has a prologue, else straight to the I/O threads."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"mover {self.name} is closed")
            self._inflight += 1
            if job.before is not None:
                self._sequenced.append(job)
            else:
                job._remaining = len(job.keys)
                (self._loads if job.is_load else self._stores).extend(
                    (job, i) for i in range(len(job.keys))
                )
            self._cond.notify_all()
        if job.before is None and not job.keys:
            self._finish(job)

    def submit_sequenced(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the sequencer, in order with store prologues (index maintenance)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"mover {self.name} is closed")
            self._inflight += 1
            self._sequenced.append(task)
            self._cond.notify_all()

    def poll(self) -> list[MoverJob]:
        """Jobs finished since the last call, each once; never waits."""
        finished = self._finished
        done = []
        while finished:
            done.append(finished.popleft())
        return done

    def pending(self) -> int:
        """Jobs submitted and not finished yet (finished ones may still await :meth:`poll`)."""
        return self._inflight

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is in flight; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout_s)

    def close(self) -> None:
        """Finish everything queued, then stop the threads. Idempotent; blocks."""
        with self._cond:
            if self._closed:
                return
        self.wait_idle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in (*self._workers, self._sequencer):
            if thread is not threading.current_thread():
                thread.join()

    # -- the mover's threads --------------------------------------------------------------------

    def _work(self) -> None:
        cond = self._cond
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
        cond = self._cond
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
                    cond.notify_all()
                continue
            job = item
            try:
                job.before(job)  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - fails this job's keys only
                reason = self._unexpected(exc, "prologue")
                job.reasons = [reason] * len(job.keys)
            todo = [
                i for i in range(len(job.keys)) if not job.skip[i] and job.reasons[i] is None
            ]
            if not todo:
                self._finish(job)
                continue
            with cond:
                job._remaining = len(todo)
                (self._loads if job.is_load else self._stores).extend((job, i) for i in todo)
                cond.notify_all()

    def _finish(self, job: MoverJob) -> None:
        if job.after is not None:
            try:
                job.after(job)
            except BaseException as exc:  # noqa: BLE001 - fails this job's keys only
                reason = self._unexpected(exc, "epilogue")
                job.reasons = [r if r is not None else reason for r in job.reasons]
        job.seconds = time.perf_counter() - job.submitted_s
        self._finished.append(job)
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _unexpected(self, exc: BaseException, where: str) -> str:
        logger.error("kvtier tier %s: unexpected error in a job's %s", self.name, where, exc_info=exc)
        return f"error: {type(exc).__name__}"

"""A secondary tier on a Valkey (or Redis) server or cluster, shared by a fleet of engines.

Every value is one block in the disk tiers' format (:mod:`kvtier.tiers.disk.format`): the
4096-byte verified header page, then the payload. A value is served only if its header names
this layout, this key and this payload length and its payload checksum holds; anything else —
another model's value, a truncated or altered value, a value under the wrong key — is a
counted miss. The key name is ``<namespace>:<hex of the offload key>``.

With ``secret_file`` (:mod:`kvtier.tiers.secret`) values carry a keyed MAC and only those
whose tag holds are served; the name is ``<namespace>:<hex of a keyed digest of the key>``,
the header holds that digest instead of the key, and the default namespace derives from the
secret, so a client without it can neither plant a value nor probe for a prefix.

**The scheduler never waits on the network.** What a lookup knows is local:

* ``True``: the key is in this process's view — stored by its jobs, or found by a read whose
  verified value is held here until the load copies it into a CPU row (no second round trip);
* ``False``: the server did not have it at a read less than ``miss_ttl_s`` ago, or the server
  is unreachable;
* ``None``: not known. The key is queued; :meth:`ValkeyTier.on_schedule_end` sends the step's
  queued keys as pipelined GETs (the existence check is the read), and a later lookup answers
  ``True`` or ``False``. A read that has not come back after ``timeout_s`` answers ``False``.

Stores and loads run pipelined on the tier's own threads (one for writes, one for reads, so
loads never queue behind stores), in batches of at most ``max_inflight_bytes``.

Every failed key's reason is a :class:`~kvtier.tiers.base.Failure`: ``MISSING``, ``CORRUPT``
(which check), ``UNAVAILABLE`` (``timeout``, ``refused``, ``closed``), ``AUTH``, ``TLS``,
``DENIED`` (an ACL's NOPERM, warned once), ``SERVER``; each counted as ``failed_<reason>`` (or
``corrupt_<check>``) in :meth:`ValkeyTier.stats`.

**A slow or dead server** (or one that refuses the credentials or the TLS handshake) costs
failed jobs after at most ``timeout_s``, and misses: on the first failure the tier logs one
warning (with the fix for its reason), forgets what it believed the server held (it may
come back empty), answers lookups ``False`` and fails jobs at once, and pings the server with
exponential backoff from the step's end; the first answer ends the outage. ``outages`` and ``outage_ms`` count them.

Threads: the scheduler thread calls every public method; the worker threads (a writer, a
reader, and a copier to which the reader hands half of a large load) only run ``_run_*``
functions, which touch the CPU rows of their job and hand their outcome back through
``_done`` (a deque), folded in by the scheduler thread. ``_lock`` guards the outage state,
which both sides change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.errors import ValkeyCheckError
from kvtier.tiers.base import CheckReport, Failure, FailureKind, SecondaryTier, TierJob, TierJobResult
from kvtier.tiers.disk.format import (
    FLAG_ENCRYPTED,
    HEADER_BYTES,
    LayoutFingerprint,
    decode_header,
    encode_header_into,
    header_flags,
    verify,
)
from kvtier.tiers.secret import tier_keys
from kvtier.tiers.valkey.check import check_namespace, namespace_names
from kvtier.tiers.valkey.config import ValkeyTierConfig, redact_url
from kvtier.tiers.valkey.connection import ValkeyConnection, fix_for, is_outage, reason_of

__all__ = ["ValkeyTier", "default_namespace"]

logger = logging.getLogger(__name__)

#: the most keys the tier remembers as present, or as missing; the oldest are forgotten first
#: (a forgotten key is asked again: one GET, never a wrong answer)
MAX_REMEMBERED_KEYS = 1 << 18
#: first and longest pause between reconnect attempts during an outage
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 5.0
#: how often the server's memory and hit counters are refreshed (from the step's end)
SERVER_FIGURES_PERIOD_S = 1.0
#: how long a read value waits here for its load before it is dropped
STAGED_TTL_S = 30.0
#: a load of at least this many bytes of read values copies them on two threads
PARALLEL_COPY_BYTES = 8 << 20


#: a job's keys while the tier is down and no reason is known (it always is, but never crash)
_UNAVAILABLE = Failure(FailureKind.UNAVAILABLE)


def _unexpected(tier: str, job: str, error: BaseException) -> Failure:
    """Any thread: an exception nobody expected, logged with its traceback; the keys' reason."""
    logger.error("valkey tier %r: a %s failed unexpectedly", tier, job, exc_info=error)
    return Failure(FailureKind.UNEXPECTED, detail=type(error).__name__)


def default_namespace(fingerprint: LayoutFingerprint) -> str:
    """``kvtier:`` and 16 hex digits of the layout's digest: one namespace per model and layout."""
    return "kvtier:" + fingerprint.digest()[:8].hex()


@dataclass
class _Probe:
    """A step's batch of reads: its keys, and when the scheduler stops waiting for it."""

    keys: list[OffloadKey]
    deadline: float


@dataclass
class _ProbeOutcome:
    """What a batch of reads found, key by key (built on a worker thread)."""

    batch: int
    #: key -> (value whose header passed, its payload checksum, checked on load)
    found: dict[OffloadKey, tuple[np.ndarray, int]] = field(default_factory=dict)
    missing: list[OffloadKey] = field(default_factory=list)
    #: key -> why its value is not this key's block of this layout (a ``CORRUPT`` failure)
    corrupt: dict[OffloadKey, Failure] = field(default_factory=dict)
    #: key -> why the server could not be asked
    failed: dict[OffloadKey, Failure] = field(default_factory=dict)


class ValkeyTier(SecondaryTier):
    """The shared tier: blocks as values on a Valkey server or cluster (see the module docstring).

    ``rows`` is the CPU tier's ``(num_rows, block_bytes)`` uint8 view; ``connection`` talks
    to the server (built from ``config`` when not given).
    """

    medium = "VALKEY"
    remote = True

    def __init__(
        self,
        config: ValkeyTierConfig,
        rows: np.ndarray,
        fingerprint: LayoutFingerprint,
        connection: ValkeyConnection | None = None,
        field: str = "tiers[1]",
    ):
        super().__init__(config.name, rows.shape[1], capacity_blocks=0)
        self.config = config
        # the secret's keys (keyed MACs, names, encryption), or None: read before connecting
        self._keys = tier_keys(config, field)
        self.namespace = config.namespace or (
            self._keys.namespace(fingerprint.digest()) if self._keys else default_namespace(fingerprint)
        )
        self._prefix = (self.namespace + ":").encode()
        self._rows = rows
        self._digest = fingerprint.digest()
        self._value_bytes = HEADER_BYTES + self.block_bytes
        # keys per pipelined batch: max_inflight_bytes of values, and at least one
        self._batch_keys = max(1, config.max_inflight_bytes // self._value_bytes)
        self._conn = connection or ValkeyConnection(config)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-w")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-r")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-c")
        # the writer thread's ciphertext buffers, one per value of a batch (encrypt only)
        self._cipher_buffers: list[np.ndarray] = []
        self._futures: set[Future] = set()
        self._load_futures: set[Future] = set()  # of those, the reads (what wait_loads waits for)

        # scheduler-thread state
        self._present: OrderedDict[OffloadKey, None] = OrderedDict()
        self._missing: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> answer False until
        # key -> (value, its payload checksum from the checked header, drop at)
        self._staged: OrderedDict[OffloadKey, tuple[np.ndarray, int, float]] = OrderedDict()
        self._staged_bytes = 0
        self._wanted: dict[OffloadKey, None] = {}
        self._probing: dict[OffloadKey, int] = {}  # key -> batch
        self._probes: dict[int, _Probe] = {}
        self._probe_ids = 0
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}
        self._jobs: dict[int, float] = {}  # job id -> submitted at
        self._finished: list[TierJobResult] = []
        self._events: list[OffloadingEvent] = []
        self._done: deque = deque()  # outcomes from the worker threads
        self._next_figures = 0.0
        self._server_figures: dict[str, int] = {}
        self.counters = dict.fromkeys(
            (
                "stored_blocks", "stored_bytes", "store_jobs", "loaded_blocks", "loaded_bytes",
                "load_jobs", "failed_keys", "corrupt_values", "probe_batches", "probed_keys",
                "probe_hits", "probe_misses", "probe_timeouts", "staged_dropped", "outages",
            ),
            0,
        )

        # outage state, shared with the worker threads
        self._lock = threading.Lock()
        self._down_since: float | None = None  # guarded by _lock
        self._down_reason: Failure | None = None
        self._warned: set[str] = set()  # reasons (denied commands ...) warned about once
        self._outage_s = 0.0
        self._backoff_s = BACKOFF_FIRST_S
        self._next_ping = 0.0
        self._pinging = False

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, config: ValkeyTierConfig, rows: np.ndarray, fingerprint: LayoutFingerprint,
             field: str = "tiers[1]") -> ValkeyTier:
        """The tier, after one PING (blocks up to ``timeout_s``). An unreachable server is not
        an error: the tier starts in an outage, logged, and connects once the server answers
        — an engine must come up whether or not the shared tier is there."""
        tier = cls(config, rows, fingerprint, field=field)
        try:
            tier._conn.ping()
        except Exception as error:
            tier._went_down(reason_of(error))
            return tier
        tier._refresh_figures()
        if tier._server_figures.get("maxmemory"):
            tier.capacity_blocks = tier._server_figures["maxmemory"] // tier._value_bytes
        return tier

    def _header_key(self, key: OffloadKey) -> bytes:
        """What stands for ``key`` in a value's name and header: the key, or with a secret its
        keyed digest (the public block hash would tell anyone which prefixes are cached)."""
        return key if self._keys is None else self._keys.name_digest(key)

    def _name(self, key: OffloadKey) -> bytes:
        return self._prefix + self._header_key(key).hex().encode()

    # -- outage ----------------------------------------------------------------------------------

    def _went_down(self, reason: Failure) -> None:
        """Any thread: the server could not be used. Logs once per outage, with the fix."""
        if not is_outage(reason):  # an ACL's refusal or an error reply: the server is there
            self._warn_once(reason)
            return
        with self._lock:
            if self._down_since is not None:
                return
            now = time.monotonic()
            self._down_since = now
            self._down_reason = reason
            self._backoff_s = BACKOFF_FIRST_S
            self._next_ping = now + BACKOFF_FIRST_S
            self.counters["outages"] += 1
        target = redact_url(self._conn.location)
        if reason.kind is FailureKind.AUTH:
            what = f"refused the credentials ({reason.detail})"
        elif reason.kind is FailureKind.TLS:
            what = f"failed the TLS handshake ({reason.detail})"
        else:
            what = f"unreachable ({reason.detail or reason})"
        logger.warning(
            "valkey tier %r: server %s %s; its jobs fail and its lookups miss until it answers "
            "again (retrying with backoff up to %.0f s). Fix: %s",
            self.name, target, what, BACKOFF_MAX_S, fix_for(reason, "check the server's log"),
        )

    def _warn_once(self, reason: Failure) -> None:
        """Log an ACL's refusal (or another error reply) once per kind and detail."""
        tag = str(reason)
        with self._lock:
            if tag in self._warned:
                return
            self._warned.add(tag)
        if reason.kind is FailureKind.DENIED:
            logger.warning(
                "valkey tier %r: the server's ACL denies %s to this user on %s: those keys fail "
                "(counted as failed_%s). Fix: %s",
                self.name, reason.detail.upper(), redact_url(self._conn.location), reason.counter,
                fix_for(reason, ""),
            )
        else:
            logger.warning(
                "valkey tier %r: the server answered %s on %s: those keys fail (counted as failed_%s)",
                self.name, reason, redact_url(self._conn.location), reason.counter,
            )

    def _count_failures(self, reasons, keys: bool = True) -> None:
        """Scheduler thread: count failed keys by reason (``failed_<reason>``, and
        ``corrupt_values``); ``keys``: they are a job's (``failed_keys``), not a probe's."""
        counters = self.counters
        for reason in reasons:
            if keys:
                counters["failed_keys"] += 1
            if reason.kind is FailureKind.CORRUPT:
                counters["corrupt_values"] += 1
                name = "corrupt_" + reason.counter
            else:
                name = "failed_" + reason.counter
            counters[name] = counters.get(name, 0) + 1
            if reason.kind in (FailureKind.DENIED, FailureKind.SERVER, FailureKind.UNEXPECTED):
                self._warn_once(reason)

    @property
    def down(self) -> bool:
        """Whether the tier is in an outage now."""
        return self._down_since is not None

    def _ping_done(self, ok: bool) -> None:
        """Worker thread: the outcome of a reconnect attempt."""
        with self._lock:
            self._pinging = False
            if self._down_since is None:
                return
            now = time.monotonic()
            if not ok:
                self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)
                self._next_ping = now + self._backoff_s
                return
            lasted = now - self._down_since
            self._outage_s += lasted
            self._down_since = None
        logger.info("valkey tier %r: server answers again after %.1f s", self.name, lasted)

    def _try_reconnect(self) -> None:
        with self._lock:
            if self._pinging or time.monotonic() < self._next_ping:
                return
            self._pinging = True

        def attempt() -> None:
            try:
                self._conn.drop_idle_connections()
                self._conn.ping()
            except Exception as error:
                # an ACL that denies PING still means a server that answers, as this user
                self._ping_done(not is_outage(reason_of(error)))
            else:
                self._ping_done(True)

        self._submit(self._reader, attempt)

    def _forget_server(self) -> None:
        """The server was away: it may have restarted empty, so nothing is known to be there."""
        self._present.clear()
        self._staged.clear()
        self._staged_bytes = 0
        self._missing.clear()

    # -- lookups ---------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        if self._done:
            self._fold()
        if key in self._present or key in self._staged:
            return True
        if key in self._writing:
            return None
        until = self._missing.get(key)
        if until is not None:
            if until > time.monotonic():
                return False
            del self._missing[key]
        if self._down_since is not None:
            return False  # nobody to ask: a miss now beats an engine that waits
        batch = self._probing.get(key)
        if batch is not None:
            if self._probes[batch].deadline > time.monotonic():
                return None
            self._expire_probe(batch)
            return False
        self._wanted[key] = None
        return None

    def touch(self, keys: Collection[OffloadKey]) -> None:
        # The server's LRU sees every GET; a touch without a read is not worth a round trip.
        return None

    def on_schedule_end(self) -> None:
        """Send the reads this step's lookups asked for, as pipelined GETs; keep in touch."""
        self._fold()
        now = time.monotonic()
        for batch in [b for b, probe in self._probes.items() if probe.deadline <= now]:
            self._expire_probe(batch)
        if self._staged:
            self._drop_stale_staged(now)
        if self._down_since is not None:
            self._wanted.clear()
            self._try_reconnect()
            return
        if self._wanted:
            # A key stored since it was asked about needs no read: the manager asks about
            # every block it stores (is it saved below already?), and most are being saved now.
            writing, present = self._writing, self._present
            keys = [key for key in self._wanted if key not in writing and key not in present]
            self._wanted.clear()
            for start in range(0, len(keys), self._batch_keys):
                self._send_probe(keys[start : start + self._batch_keys], now)
        if now >= self._next_figures:
            self._next_figures = now + SERVER_FIGURES_PERIOD_S
            self._submit(self._reader, self._refresh_figures)

    def _send_probe(self, keys: list[OffloadKey], now: float) -> None:
        self._probe_ids += 1
        batch = self._probe_ids
        self._probes[batch] = _Probe(keys, now + self.config.timeout_s)
        for key in keys:
            self._probing[key] = batch
        self.counters["probe_batches"] += 1
        self.counters["probed_keys"] += len(keys)
        # A probe is the read that answers a lookup: who waits for loads waits for it too
        self._load_futures.add(future := self._submit(self._reader, self._run_probe, batch, keys))
        future.add_done_callback(self._load_futures.discard)

    def _expire_probe(self, batch: int) -> None:
        """A batch of reads outlived ``timeout_s``: its keys miss (a late reply is ignored)."""
        probe = self._probes.pop(batch)
        until = time.monotonic() + self.config.miss_ttl_s
        for key in probe.keys:
            if self._probing.get(key) == batch:
                del self._probing[key]
                self._remember_missing(key, until)
        self.counters["probe_timeouts"] += len(probe.keys)

    def _remember_missing(self, key: OffloadKey, until: float) -> None:
        self._missing[key] = until
        self._missing.move_to_end(key)
        if len(self._missing) > MAX_REMEMBERED_KEYS:
            self._missing.popitem(last=False)

    def _remember_present(self, key: OffloadKey) -> None:
        self._present[key] = None
        self._present.move_to_end(key)
        if len(self._present) > MAX_REMEMBERED_KEYS:
            self._present.popitem(last=False)

    def _drop_stale_staged(self, now: float) -> None:
        while self._staged:
            key, (value, _, until) = next(iter(self._staged.items()))
            if until > now:
                break
            del self._staged[key]
            self._staged_bytes -= len(value)
            self.counters["staged_dropped"] += 1

    # -- jobs ------------------------------------------------------------------------------------

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future:
        future = pool.submit(fn, *args)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return future

    def submit_store(self, job: TierJob) -> None:
        self._jobs[job.job_id] = time.perf_counter()
        self.counters["store_jobs"] += 1
        result = TierJobResult(job.job_id, is_load=False)
        todo: list[tuple[OffloadKey, int]] = []
        for key, row in zip(job.keys, job.rows):
            if key in self._present:
                result.ok.append(key)  # the server has it (as far as this process knows)
            else:
                todo.append((key, row))
        if self._down_since is not None:
            for key, _ in todo:
                result.failed[key] = self._down_reason or _UNAVAILABLE
            todo = []
        if not todo:
            self._done.append(("store", result, []))
            return
        self._writing.update(key for key, _ in todo)
        self._submit(self._writer, self._run_store, result, todo)

    def submit_load(self, job: TierJob) -> None:
        self._jobs[job.job_id] = time.perf_counter()
        self.counters["load_jobs"] += 1
        for key in job.keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        staged: dict[OffloadKey, tuple[np.ndarray, int]] = {}
        for key in job.keys:
            entry = self._staged.pop(key, None)
            if entry is not None:
                staged[key] = entry[:2]
                self._staged_bytes -= len(entry[0])
        result = TierJobResult(job.job_id, is_load=True)
        if self._down_since is not None and len(staged) < len(job.keys):
            for key in job.keys:
                if key not in staged:
                    result.failed[key] = self._down_reason or _UNAVAILABLE
        future = self._submit(self._reader, self._run_load, result, list(zip(job.keys, job.rows)), staged)
        self._load_futures.add(future)
        future.add_done_callback(self._load_futures.discard)

    def get_finished_jobs(self) -> list[TierJobResult]:
        self._fold()
        finished, self._finished = self._finished, []
        return finished

    def drain_jobs(self) -> None:
        while self._futures:
            wait(list(self._futures))

    def wait_loads(self) -> None:
        # Loads run on their own pool and connections: a store stuck behind a slow or paused
        # write does not hold them up, nor does this wait for it.
        while self._load_futures:
            wait(list(self._load_futures))

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def num_blocks(self) -> int:
        """Blocks this process knows the server holds (its own stores and reads, at most
        :data:`MAX_REMEMBERED_KEYS`); the server may hold more, from other engines."""
        return len(self._present)

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    # -- the worker threads ----------------------------------------------------------------------

    def _encode(self, key: OffloadKey, row: int, slot: int = 0) -> tuple[bytes, memoryview]:
        """The value of ``key``: its header page, then the CPU row itself (sent as it is), or
        encrypting, its ciphertext in the writer's buffer ``slot`` (one per value of a batch)."""
        payload = self._rows[row]
        header = bytearray(HEADER_BYTES)
        keys = self._keys
        if keys is None:
            encode_header_into(
                header, layout_digest=self._digest, key=key, payload_bytes=self.block_bytes,
                checksum=xxhash.xxh3_64_intdigest(payload),
            )
            return bytes(header), payload.data
        encode_header_into(
            header, layout_digest=self._digest, key=keys.name_digest(key),
            payload_bytes=self.block_bytes, checksum=0, flags=keys.flags, salt=keys.new_salt(),
        )
        out = None
        if keys.encrypt:
            # Reused from batch to batch: a fresh 2 MiB buffer per value cost more than the
            # cipher (page faults: 64 MiB of new buffers took 140 ms here, AES-GCM 15 ms).
            buffers = self._cipher_buffers
            while len(buffers) <= slot:
                buffers.append(np.empty(self.block_bytes, dtype=np.uint8))
            out = buffers[slot]
        sealed = keys.seal(header, payload, out)  # the ciphertext when encrypting, else the row
        return bytes(header), memoryview(sealed).cast("B")

    def _run_store(self, result: TierJobResult, todo: list[tuple[OffloadKey, int]]) -> None:
        stored: list[OffloadKey] = []
        ttl = self.config.ttl_s
        outage = None
        try:
            for start in range(0, len(todo), self._batch_keys):
                chunk = todo[start : start + self._batch_keys]
                if outage is not None:
                    for key, _ in chunk:
                        result.failed[key] = outage
                    continue
                names = [self._name(key) for key, _ in chunk]
                values = [self._encode(key, row, slot) for slot, (key, row) in enumerate(chunk)]
                reasons = self._conn.set_many(names, values, ttl)
                del values
                for (key, _), reason in zip(chunk, reasons):
                    if reason is None:
                        stored.append(key)
                    else:
                        result.failed[key] = reason
                if reasons and all(r is not None and is_outage(r) for r in reasons):
                    outage = reasons[0]
        except Exception as error:  # a bug or an unexpected client error: fail, never crash
            failure = _unexpected(self.name, "store", error)
            for key, _ in todo:
                if key not in stored:
                    result.failed.setdefault(key, failure)
        if outage is not None:
            self._went_down(outage)
        result.ok.extend(stored)
        result.nbytes = len(stored) * self.block_bytes
        self._done.append(("store", result, stored))

    def _place(self, key: OffloadKey, target: np.ndarray, value, checksum: int | None = None) -> Failure | None:
        """Copy ``value``'s payload into ``target`` (a CPU row) and verify it there; why not, or None.

        ``checksum``: the payload checksum of a value whose header was checked already (when
        it was read at the end of a step); only the payload is checked then.
        """
        if isinstance(value, Failure):
            return value
        if not isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
            return Failure.MISSING
        view = memoryview(value)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        if checksum is not None and self._keys is None and len(view) == self._value_bytes:
            target[:] = np.frombuffer(view, dtype=np.uint8, offset=HEADER_BYTES)
            digest = xxhash.xxh3_64_intdigest(target)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
            return None if digest == checksum else Failure.corrupt("checksum")
        if len(view) < self._value_bytes:
            return Failure.corrupt("truncated")
        if len(view) > self._value_bytes:
            return Failure.corrupt("payload length")
        received = np.frombuffer(view, dtype=np.uint8, offset=HEADER_BYTES)
        source = None
        if self._keys is not None and header_flags(view) & FLAG_ENCRYPTED:
            source = received  # decrypted straight into the row: a copy first would cost as much
        else:
            target[:] = received
        # Verified where the bytes will be served from, after the copy: nothing else is trusted.
        reason = verify(
            view[:HEADER_BYTES], target, len(view), key=self._header_key(key),
            layout_digest=self._digest, payload_bytes=self.block_bytes, keys=self._keys,
            source=source,
        )
        return None if reason is None else Failure.corrupt(reason)

    def _place_all(self, pairs: list[tuple[OffloadKey, int]], values: dict[OffloadKey, tuple[np.ndarray, int]]) -> dict:
        """:meth:`_place` each key's read value (and checksum) into its row: key -> why not, or None."""
        rows = self._rows
        return {key: self._place(key, rows[row], *values[key]) for key, row in pairs}

    def _run_load(self, result: TierJobResult, pairs: list[tuple[OffloadKey, int]],
                  staged: dict[OffloadKey, tuple[np.ndarray, int]]) -> None:
        try:
            fetch = [(key, row) for key, row in pairs if key not in staged and key not in result.failed]
            local = [(key, row) for key, row in pairs if key in staged]
            if len(local) > 1 and len(local) * self._value_bytes >= PARALLEL_COPY_BYTES:
                # Copy and checksum release the GIL: a second thread halves a large job's
                # time on an otherwise idle core (the server has nothing to do meanwhile).
                half = len(local) // 2
                theirs = self._copier.submit(self._place_all, local[:half], staged)
                reasons = {**self._place_all(local[half:], staged), **theirs.result()}
            else:
                reasons = self._place_all(local, staged)
            for key, _ in local:
                if reasons[key] is None:
                    result.ok.append(key)
                else:
                    result.failed[key] = reasons[key]
            outage: Failure | None = None
            for start in range(0, len(fetch), self._batch_keys):
                chunk = fetch[start : start + self._batch_keys]
                if outage is not None:
                    for key, _ in chunk:
                        result.failed[key] = outage
                    continue
                values = self._conn.get_many([self._name(key) for key, _ in chunk], self._value_bytes)
                for (key, row), value in zip(chunk, values):
                    reason = self._place(key, self._rows[row], value)
                    if reason is None:
                        result.ok.append(key)
                    else:
                        result.failed[key] = reason
                first = values[0] if values else None
                if isinstance(first, Failure) and all(is_outage(v) for v in values):
                    outage = first
            if outage is not None:
                self._went_down(outage)
        except Exception as error:
            failure = _unexpected(self.name, "load", error)
            for key, _ in pairs:
                if key not in result.ok:
                    result.failed.setdefault(key, failure)
        result.nbytes = len(result.ok) * self.block_bytes
        self._done.append(("load", result, None))

    def _check_header(self, key: OffloadKey, value: np.ndarray) -> str | int:
        """The cheap checks of a read value (all but the payload checksum, left to the load):
        why it is not this key's block of this layout, or its payload checksum."""
        if len(value) < HEADER_BYTES:
            return "truncated"
        header = decode_header(memoryview(value)[:HEADER_BYTES])  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
        if isinstance(header, str):
            return header
        if header.layout_digest != self._digest:
            return "other layout"
        if header.key != self._header_key(key):
            return "other key"
        if bool(header.flags) != (self._keys is not None):
            # the tag itself is checked on load, where the payload lands (see _place)
            return "unkeyed" if self._keys is not None else "keyed (no secret here)"
        if header.payload_bytes != self.block_bytes or len(value) != self._value_bytes:
            return "truncated" if len(value) < self._value_bytes else "payload length"
        return header.checksum

    def _run_probe(self, batch: int, keys: list[OffloadKey]) -> None:
        outcome = _ProbeOutcome(batch)
        try:
            values = self._conn.get_many([self._name(key) for key in keys], self._value_bytes)
            for key, value in zip(keys, values):
                if isinstance(value, Failure):
                    if value.kind is FailureKind.CORRUPT:  # a value of the wrong length, never held
                        outcome.corrupt[key] = value
                    else:
                        outcome.failed[key] = value
                elif value is None:
                    outcome.missing.append(key)
                else:
                    checked = self._check_header(key, value)
                    if isinstance(checked, int):
                        outcome.found[key] = (value, checked)
                    else:
                        outcome.corrupt[key] = Failure.corrupt(checked)
            if len(outcome.found) * 2 < len(keys):
                # The values are slices of one array for the whole batch, and a held slice
                # keeps all of it: with few hits, copy them out so the batch can go (the held
                # bytes then are what the staging budget counts).
                outcome.found = {key: (value.copy(), checksum) for key, (value, checksum) in outcome.found.items()}
            first = values[0] if values else None
            if isinstance(first, Failure) and all(is_outage(v) for v in values):
                self._went_down(first)
        except Exception as error:
            failure = _unexpected(self.name, "probe", error)
            for key in keys:
                outcome.failed[key] = failure
        self._done.append(("probe", outcome, None))

    def _refresh_figures(self) -> None:
        try:
            self._server_figures = self._conn.server_figures()
        except Exception:  # figures are best effort; an outage shows in the job results
            pass

    # -- folding outcomes in (scheduler thread) --------------------------------------------------

    def _fold(self) -> None:
        done = self._done
        if self._down_since is not None and (self._present or self._staged):
            self._forget_server()
        while done:
            kind, outcome, extra = done.popleft()
            if kind == "probe":
                self._fold_probe(outcome)
                continue
            result: TierJobResult = outcome
            submitted = self._jobs.pop(result.job_id, None)
            result.seconds = time.perf_counter() - submitted if submitted is not None else 0.0
            self._count_failures(result.failed.values())
            if kind == "store":
                self._writing.difference_update(extra)
                self._writing.difference_update(result.failed)
                if self._down_since is None:
                    for key in extra:
                        self._remember_present(key)
                        self._missing.pop(key, None)
                if extra:
                    self.counters["stored_blocks"] += len(extra)
                    self.counters["stored_bytes"] += len(extra) * self.block_bytes
                    self._events.append(OffloadingEvent(list(extra), self.block_bytes, self.medium, False))
            else:
                for key in result.ok:
                    self._remember_present(key)
                until = time.monotonic() + self.config.miss_ttl_s
                for key, reason in result.failed.items():
                    self._present.pop(key, None)
                    if reason.block_gone:
                        self._remember_missing(key, until)
                self.counters["loaded_blocks"] += len(result.ok)
                self.counters["loaded_bytes"] += result.nbytes
                reading = self._reading
                for key in {**dict.fromkeys(result.ok), **result.failed}:
                    left = reading.get(key, 1) - 1
                    if left > 0:
                        reading[key] = left
                    else:
                        reading.pop(key, None)
            self._finished.append(result)

    def _fold_probe(self, outcome: _ProbeOutcome) -> None:
        if self._probes.pop(outcome.batch, None) is None:
            return  # expired: its keys already answered False
        until = time.monotonic() + self.config.miss_ttl_s
        for key in [*outcome.found, *outcome.missing, *outcome.corrupt, *outcome.failed]:
            if self._probing.get(key) == outcome.batch:
                del self._probing[key]
        budget = self.config.max_inflight_bytes
        now = time.monotonic()
        for key, (value, checksum) in outcome.found.items():
            self.counters["probe_hits"] += 1
            if self._staged_bytes + len(value) <= budget:
                self._staged[key] = (value, checksum, now + STAGED_TTL_S)
                self._staged_bytes += len(value)
            else:
                # No room to hold the value: the load reads it again (a second round trip).
                self.counters["staged_dropped"] += 1
            self._remember_present(key)
        self.counters["probe_misses"] += len(outcome.missing) + len(outcome.corrupt) + len(outcome.failed)
        self._count_failures(outcome.corrupt.values(), keys=False)
        self._count_failures(outcome.failed.values(), keys=False)
        for key in [*outcome.missing, *outcome.corrupt, *outcome.failed]:
            self._remember_missing(key, until)

    # -- figures, check, close -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The tier's counters, the outage figures and the server's (refreshed every second)."""
        with self._lock:
            outage_s = self._outage_s
            if self._down_since is not None:
                outage_s += time.monotonic() - self._down_since
        figures = dict(self.counters)
        figures.update(
            down=int(self._down_since is not None),
            outage_ms=int(outage_s * 1000),
            staged_blocks=len(self._staged),
            staged_bytes=self._staged_bytes,
            known_blocks=len(self._present),
        )
        for name, value in self._server_figures.items():
            figures["server_" + name] = value
        return figures

    def check(self, fix: bool = False) -> CheckReport:
        """Read every value of the namespace and verify it against this tier's layout; with
        ``fix``, DEL the bad ones. Blocks. The same code as ``kvtier check valkey://...``
        (:func:`~kvtier.tiers.valkey.check.check_namespace`), told the layout. Raises
        :class:`~kvtier.errors.ValkeyCheckError` if the server does not answer."""
        try:
            names = namespace_names(self._conn, self.namespace)[self.namespace]
        except Exception as error:
            raise ValkeyCheckError(
                redact_url(self._conn.location), f"listing the namespace failed ({reason_of(error)})",
                "make sure the server is up, then check again",
            ) from None
        found = check_namespace(
            self._conn, self.namespace, names, fix=fix, layout_digest=self._digest,
            payload_bytes=self.block_bytes, batch_bytes=self.config.max_inflight_bytes,
            keys=self._keys,
        )
        return CheckReport(self.name, found.blocks_checked, found.problems, found.fixed)

    def close(self) -> None:
        self.drain_jobs()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._conn.close()

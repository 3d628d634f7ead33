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

**In a cluster** one node is not the tier (:mod:`~kvtier.tiers.valkey.topology`): a node that
fails a round trip is down, and only the keys of its slots miss (as ``unavailable``) and fail
at once while the others are served; the slot map is read again at most every second until
another node serves those slots (a replica promoted) or the node answers a PING. Keys
answered MOVED or ASK (slots being moved) are sent on to the node named. Only when every node
serving slots is down is the tier in an outage.

Threads: the scheduler thread calls every public method; the worker threads (a writer, a
reader, and a copier to which the reader hands half of a large load) only run the ``run_*``
methods of :class:`~kvtier.tiers.valkey.worker.ValueIO`, which touch the CPU rows of their
job and hand their outcome back through ``_done`` (a deque), folded in by the scheduler
thread. A background thread runs what must never hold up a load: the server's figures,
sibling probes, and reading a cluster's slot map. The outage state
(:mod:`~kvtier.tiers.valkey.outage`) is shared by both sides, under its own lock; a step's
reads are :mod:`~kvtier.tiers.valkey.probe` batches.

Not an :class:`~kvtier.tiers.indexed.IndexedTier`: that one's index is its eviction policy,
authoritative and bounded by ``capacity_blocks``; here the server owns capacity and eviction,
and this process keeps only a forgetful memory of what it saw, asked for by reads
(docs/design/valkey-client.md#why-valkeytier-is-not-an-indexedtier).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from kvtier.base import OffloadingEvent, OffloadKey
from kvtier.codecs import make_codec
from kvtier.errors import ValkeyCheckError
from kvtier.tiers.contract import SecondaryTier
from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint
from kvtier.tiers.jobs import CheckReport, Failure, FailureKind, TierJob, TierJobResult
from kvtier.tiers.secret import tier_keys
from kvtier.tiers.valkey.check import check_namespace, namespace_names
from kvtier.tiers.valkey.siblings import SiblingProbe
from kvtier.tiers.valkey.config import ValkeyTierConfig, redact_url
from kvtier.tiers.valkey.connection import ValkeyConnection, fix_for, is_outage, reason_of
from kvtier.tiers.valkey.outage import BACKOFF_MAX_S, Outage
from kvtier.tiers.valkey.probe import Probe, ProbeOutcome
from kvtier.tiers.valkey.worker import ValueIO

__all__ = ["ValkeyTier", "default_namespace"]

logger = logging.getLogger(__name__)

#: the most keys the tier remembers as present, or as missing; the oldest are forgotten first
#: (a forgotten key is asked again: one GET, never a wrong answer)
MAX_REMEMBERED_KEYS = 1 << 18
#: the most keys whose failed read's reason is kept for :meth:`ValkeyTier.miss_reason`
MAX_MISS_REASONS = 4096
#: how often the server's memory and hit counters are refreshed (from the step's end)
SERVER_FIGURES_PERIOD_S = 1.0
#: how long a read value waits here for its load before it is dropped
STAGED_TTL_S = 30.0


#: a job's keys while the tier is down and no reason is known (it always is, but never crash)
_UNAVAILABLE = Failure(FailureKind.UNAVAILABLE)
#: a read that outlived timeout_s
_TIMEOUT = Failure(FailureKind.UNAVAILABLE, detail="timeout")
#: failures ``stats()`` shows at 0 before the first one (as IndexedTier.zero_failures): an
#: unreachable server, refused credentials, a full server, a value that fails its checksum
ZERO_FAILURES = (
    _TIMEOUT,
    *(Failure(FailureKind.UNAVAILABLE, detail=detail) for detail in ("refused", "connection", "closed")),
    Failure(FailureKind.AUTH, detail="wrong credentials"),
    Failure(FailureKind.SERVER, detail="OOM"),
    Failure.corrupt("checksum"),
)


def _counter_of(reason: Failure) -> str:
    """The stats key counting ``reason``: ``corrupt_<check>``, else ``failed_<reason>``."""
    return ("corrupt_" if reason.kind is FailureKind.CORRUPT else "failed_") + reason.counter


def default_namespace(fingerprint: LayoutFingerprint) -> str:
    """``kvtier:`` and 16 hex digits of the layout's digest: one namespace per model and layout."""
    return "kvtier:" + fingerprint.digest()[:8].hex()


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
        #: the codec values are stored with, or None
        self.codec = make_codec(config.codec, rows.shape[1], fingerprint.dtype, field)
        # the layout as stored: another codec's values are another layout (another namespace)
        fingerprint = fingerprint.with_codec(config.codec)
        self.namespace = config.namespace or (
            self._keys.namespace(fingerprint.digest()) if self._keys else default_namespace(fingerprint)
        )
        self._prefix = (self.namespace + ":").encode()
        self._rows = rows
        self._digest = fingerprint.digest()
        self._value_bytes = HEADER_BYTES + (
            self.codec.max_encoded_bytes if self.codec is not None else self.block_bytes
        )
        # keys per pipelined batch: max_inflight_bytes of values, and at least one
        self._batch_keys = max(1, config.max_inflight_bytes // self._value_bytes)
        self._conn = connection or ValkeyConnection(config)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-w")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-r")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-c")
        # best-effort round trips that must never hold up a load (a stalled cluster node
        # holds its caller for timeout_s): sibling probes, and (not waited for by
        # drain_jobs: they are no one's job) the server's figures and slot maps
        self._background = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{config.name}-b")
        self._futures: set[Future] = set()
        self._load_futures: set[Future] = set()  # of those, the reads (what wait_loads waits for)

        # scheduler-thread state
        self._present: OrderedDict[OffloadKey, None] = OrderedDict()
        #: why a read found a key bad or could not ask (corrupt, timeout ...): the last few
        self._miss_reasons: OrderedDict[OffloadKey, Failure] = OrderedDict()
        self._missing: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> answer False until
        # key -> (value, its payload checksum from the checked header, drop at)
        self._staged: OrderedDict[OffloadKey, tuple[np.ndarray, int, float]] = OrderedDict()
        self._staged_bytes = 0
        self._wanted: dict[OffloadKey, None] = {}
        self._probing: dict[OffloadKey, int] = {}  # key -> batch
        self._probes: dict[int, Probe] = {}
        self._probe_ids = 0
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}
        self._jobs: dict[int, float] = {}  # job id -> submitted at
        self._finished: list[TierJobResult] = []
        self._events: list[OffloadingEvent] = []
        self._done: deque = deque()  # outcomes from the worker threads
        self._io = ValueIO(
            config.name,
            self._conn,
            rows,
            self._keys,
            self._digest,
            self._prefix,
            self._batch_keys,
            config.ttl_s,
            self._copier,
            self._done,
            self._went_down,
            self.codec,
        )
        self._next_figures = 0.0
        self._figures: Future = Future()  # the last refresh of the server's figures
        self._figures.set_result(None)
        self._server_figures: dict[str, int] = {}
        self.counters = dict.fromkeys(
            (
                "stored_blocks",
                "stored_bytes",
                "store_jobs",
                "loaded_blocks",
                "loaded_bytes",
                "load_jobs",
                "failed_keys",
                "corrupt_values",
                "probe_batches",
                "probed_keys",
                "probe_hits",
                "probe_misses",
                "probe_timeouts",
                "staged_dropped",
                "outages",
                *map(_counter_of, ZERO_FAILURES),
            ),
            0,
        )

        # outage state, shared with the worker threads
        self._outage = Outage(self.counters)
        # near-miss probes of other namespaces (not with a secret: see siblings.py)
        self._siblings = (
            SiblingProbe(lambda: self._conn.client, self.namespace, fingerprint)
            if self._keys is None
            else None
        )

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        config: ValkeyTierConfig,
        rows: np.ndarray,
        fingerprint: LayoutFingerprint,
        field: str = "tiers[1]",
    ) -> ValkeyTier:
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
        """What stands for ``key`` in a value's name and header (see :meth:`ValueIO.header_key`)."""
        return self._io.header_key(key)

    def _name(self, key: OffloadKey) -> bytes:
        return self._io.name_of(key)

    # -- outage ----------------------------------------------------------------------------------

    def _went_down(self, reason: Failure) -> None:
        """Any thread: the server could not be used. Logs once per outage, with the fix."""
        if not is_outage(reason):  # an ACL's refusal or an error reply: the server is there
            self._warn_once(reason)
            return
        if not self._outage.begin(reason):
            return
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
            self.name,
            target,
            what,
            BACKOFF_MAX_S,
            fix_for(reason, "check the server's log"),
        )

    def _warn_once(self, reason: Failure) -> None:
        """Log an ACL's refusal (or another error reply) once per kind and detail."""
        if not self._outage.first_warning(str(reason)):
            return
        if reason.kind is FailureKind.DENIED:
            logger.warning(
                "valkey tier %r: the server's ACL denies %s to this user on %s: those keys fail "
                "(counted as failed_%s). Fix: %s",
                self.name,
                reason.detail.upper(),
                redact_url(self._conn.location),
                reason.counter,
                fix_for(reason, ""),
            )
        else:
            logger.warning(
                "valkey tier %r: the server answered %s on %s: those keys fail (counted as failed_%s)",
                self.name,
                reason,
                redact_url(self._conn.location),
                reason.counter,
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
            name = _counter_of(reason)
            counters[name] = counters.get(name, 0) + 1
            if reason.kind in (FailureKind.DENIED, FailureKind.SERVER, FailureKind.UNEXPECTED):
                self._warn_once(reason)

    @property
    def down(self) -> bool:
        """Whether the tier is in an outage now."""
        return self._outage.down

    def _ping_done(self, ok: bool) -> None:
        """Worker thread: the outcome of a reconnect attempt."""
        lasted = self._outage.ping_done(ok)
        if lasted is None:
            return
        logger.info("valkey tier %r: server answers again after %.1f s", self.name, lasted)

    def _try_reconnect(self) -> None:
        if not self._outage.ping_due():
            return

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
        if key in self._staged:
            return True  # read and checked already: served whatever happens to its node
        # a cluster node that is down: its keys miss at once, the other nodes' are served
        node_down = self._conn.node_failure(self._name(key)) if self._nodes_down() else None
        if key in self._present:
            return node_down is None
        if key in self._writing:
            return None
        until = self._missing.get(key)
        if until is not None:
            if until > time.monotonic():
                return False
            del self._missing[key]
        if self._outage.down or node_down is not None:
            return False  # nobody to ask: a miss now beats an engine that waits
        batch = self._probing.get(key)
        if batch is not None:
            if self._probes[batch].deadline > time.monotonic():
                return None
            self._expire_probe(batch)
            return False
        self._wanted[key] = None
        return None

    def probe_foreign(self, key: OffloadKey) -> None:
        # not while a cluster node is down: the probe goes through the client's own commands,
        # which a stalled node would hold for timeout_s each (the diagnosis can wait)
        if self._siblings is not None and not self._outage.down and not self._nodes_down():
            self._siblings.want(key)

    def foreign_found(self) -> list[tuple[OffloadKey, str]]:
        return self._siblings.take_found() if self._siblings is not None else []

    def miss_reason(self, key: OffloadKey) -> Failure | None:
        if self._outage.down:
            return self._outage.reason or _UNAVAILABLE
        if self._nodes_down():
            reason = self._conn.node_failure(self._name(key))
            if reason is not None:
                return reason
        return self._miss_reasons.get(key)

    def _nodes_down(self) -> bool:
        """Whether some node of the cluster is down now (never for a standalone server)."""
        health = self._conn.health
        return health is not None and bool(health.down_nodes)

    def _remember_reason(self, key: OffloadKey, reason: Failure) -> None:
        reasons = self._miss_reasons
        reasons[key] = reason
        reasons.move_to_end(key)
        if len(reasons) > MAX_MISS_REASONS:
            reasons.popitem(last=False)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        # The server's LRU sees every GET; a touch without a read is not worth a round trip.
        return None

    def on_schedule_end(self) -> None:
        """Send the reads this step's lookups asked for, as pipelined GETs; keep in touch."""
        self._fold()
        health = self._conn.health
        if health is not None and health.read_due():  # a node down, or a MOVED: read the slot map
            self._background.submit(self._refresh_topology)
        now = time.monotonic()
        for batch in [b for b, probe in self._probes.items() if probe.deadline <= now]:
            self._expire_probe(batch)
        if self._staged:
            self._drop_stale_staged(now)
        if self._outage.down:
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
        if self._siblings is not None and not self._nodes_down():
            self._siblings.send(lambda fn, *args: self._submit(self._background, fn, *args))
        if now >= self._next_figures and self._figures.done():  # one at a time: a slow server
            self._next_figures = now + SERVER_FIGURES_PERIOD_S  # must not pile them up
            self._figures = self._background.submit(self._refresh_figures)

    def _send_probe(self, keys: list[OffloadKey], now: float) -> None:
        self._probe_ids += 1
        batch = self._probe_ids
        self._probes[batch] = Probe(keys, now + self.config.timeout_s)
        for key in keys:
            self._probing[key] = batch
        self.counters["probe_batches"] += 1
        self.counters["probed_keys"] += len(keys)
        # A probe is the read that answers a lookup: who waits for loads waits for it too
        self._load_futures.add(future := self._submit(self._reader, self._io.run_probe, batch, keys))
        future.add_done_callback(self._load_futures.discard)

    def _expire_probe(self, batch: int) -> None:
        """A batch of reads outlived ``timeout_s``: its keys miss (a late reply is ignored)."""
        probe = self._probes.pop(batch)
        until = time.monotonic() + self.config.miss_ttl_s
        for key in probe.keys:
            if self._probing.get(key) == batch:
                del self._probing[key]
                self._remember_missing(key, until)
                self._remember_reason(key, _TIMEOUT)
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
        if self._outage.down:
            for key, _ in todo:
                result.failed[key] = self._outage.reason or _UNAVAILABLE
            todo = []
        if not todo:
            self._done.append(("store", result, []))
            return
        self._writing.update(key for key, _ in todo)
        self._submit(self._writer, self._io.run_store, result, todo)

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
        if self._outage.down and len(staged) < len(job.keys):
            for key in job.keys:
                if key not in staged:
                    result.failed[key] = self._outage.reason or _UNAVAILABLE
        future = self._submit(self._reader, self._io.run_load, result, list(zip(job.keys, job.rows)), staged)
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

    def _refresh_topology(self) -> None:
        try:
            self._conn.refresh_topology()
        except Exception:  # no node answered: the next read is due after a pause
            pass

    def _refresh_figures(self) -> None:
        try:
            self._server_figures = self._conn.server_figures()
        except Exception:  # figures are best effort; an outage shows in the job results
            pass

    # -- folding outcomes in (scheduler thread) --------------------------------------------------

    def _fold(self) -> None:
        done = self._done
        if self._outage.down and (self._present or self._staged):
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
                if not self._outage.down:
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

    def _fold_probe(self, outcome: ProbeOutcome) -> None:
        if self._probes.pop(outcome.batch, None) is None:
            # Expired: its keys answered False already. The values it found are this
            # layout's blocks all the same (a stalled cluster node held the batch up, say,
            # while the others answered): held, the next lookup is a hit.
            self._stage(outcome.found)
            for key in outcome.found:
                self._missing.pop(key, None)
                self._miss_reasons.pop(key, None)
            return
        until = time.monotonic() + self.config.miss_ttl_s
        for key in [*outcome.found, *outcome.missing, *outcome.corrupt, *outcome.failed]:
            if self._probing.get(key) == outcome.batch:
                del self._probing[key]
        # A key of a cluster node that is down misses through the node's state, which ends
        # as soon as another node serves its slots: remembered as missing, it would miss on.
        cluster = self._conn.health is not None
        failed = [key for key, reason in outcome.failed.items() if not (cluster and is_outage(reason))]
        self._stage(outcome.found)
        self.counters["probe_misses"] += len(outcome.missing) + len(outcome.corrupt) + len(outcome.failed)
        self._count_failures(outcome.corrupt.values(), keys=False)
        self._count_failures(outcome.failed.values(), keys=False)
        for key in [*outcome.missing, *outcome.corrupt, *failed]:
            self._remember_missing(key, until)
        for key in [*outcome.found, *outcome.missing]:
            self._miss_reasons.pop(key, None)
        for key, reason in [*outcome.corrupt.items(), *outcome.failed.items()]:
            self._remember_reason(key, reason)

    def _stage(self, found: dict[OffloadKey, tuple[np.ndarray, int]]) -> None:
        """Hold the values a read found (up to ``max_inflight_bytes``) for their loads."""
        budget = self.config.max_inflight_bytes
        now = time.monotonic()
        for key, (value, checksum) in found.items():
            self.counters["probe_hits"] += 1
            held = self._staged.pop(key, None)
            if held is not None:  # read twice (an expired batch came in late)
                self._staged_bytes -= len(held[0])
            if self._staged_bytes + len(value) <= budget:
                self._staged[key] = (value, checksum, now + STAGED_TTL_S)
                self._staged_bytes += len(value)
            else:
                # No room to hold the value: the load reads it again (a second round trip).
                self.counters["staged_dropped"] += 1
            self._remember_present(key)

    # -- figures, check, close -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The tier's counters, the outage figures and the server's (refreshed every second)."""
        outage_s = self._outage.seconds()
        figures = dict(self.counters)
        figures.update(
            down=int(self._outage.down),
            outage_ms=int(outage_s * 1000),
            staged_blocks=len(self._staged),
            staged_bytes=self._staged_bytes,
            known_blocks=len(self._present),
            # what went over the wire as values, headers and payloads (encoded, with a codec)
            sent_value_bytes=self._io.sent_bytes,
            received_value_bytes=self._io.received_bytes,
        )
        if self._siblings is not None:
            figures.update(sibling_probed_keys=self._siblings.probed, sibling_found_keys=self._siblings.found)
        health = self._conn.health
        if health is not None:  # a cluster's: its nodes' outages, redirects and slot map reads
            figures.update(health.counters, nodes_down=len(health.down_nodes))
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
                redact_url(self._conn.location),
                f"listing the namespace failed ({reason_of(error)})",
                "make sure the server is up, then check again",
            ) from None
        found = check_namespace(
            self._conn,
            self.namespace,
            names,
            fix=fix,
            layout_digest=self._digest,
            payload_bytes=self._io.payload_bytes,
            codec=self._io.descriptor,
            exact=self._io.exact,
            batch_bytes=self.config.max_inflight_bytes,
            keys=self._keys,
        )
        return CheckReport(self.name, found.blocks_checked, found.problems, found.fixed)

    def close(self) -> None:
        self.drain_jobs()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._background.shutdown(wait=True)
        self._conn.close()

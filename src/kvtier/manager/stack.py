"""An OffloadingManager over an ordered stack: the CPU tier, then secondary tiers (disk ...).

The CPU tier is the gateway (docs/architecture.md): every load into the GPU comes from it and
every store from the GPU lands in it first. Secondary tiers only exchange blocks with it:

* **promotion** — a key found only below makes :meth:`TierStackManager.lookup` queue the read
  and answer ``None``; :meth:`~TierStackManager.on_schedule_end` reserves CPU rows for the
  step's queued reads and submits them as one job per tier; once the read is verified the key
  looks up ``True``. A key wanted by two requests is read once. A failed or corrupt read frees the row
  and the key looks up ``False`` until the next step ends (a later lookup reads again).
* **demotion** — a CPU block not yet saved below is *dirty* and held: CPU eviction never drops
  it. ``write_back`` saves the coldest dirty blocks at ``on_schedule_end`` whenever the clean
  headroom of the CPU tier (a quarter of its rows, or the largest store refused lately if
  larger) runs low, so eviction finds clean victims ahead of need;
  ``write_through`` saves every block soon after it is stored. A block a tier refuses (a failed
  job: full, ENOSPC, EIO ...) stops being dirty — the tier would not take it — and becomes
  evictable.

**The cascade** (per tier, ``receives``): a ``saved`` tier (the default, a mirror) is
sent every dirty block as above. An ``evicted`` tier (a victim tier) is sent only blocks that
leave the CPU tier: once no ``saved`` tier above it in the list keeps a block (there is none,
or each refused, failed or did not admit it), the block waits in the *spill* queue, still held;
when the CPU tier's clean headroom runs low (the ``write_back`` trigger, whatever the write
policy), the coldest of them are written to the victim tiers, and each becomes evictable once
those jobs end (saved or failed). A block a ``saved`` tier above keeps is never written to the
victim tier. ``shutdown`` spills what is left: the whole CPU tier is leaving.

**Admission** (optional, per tier): a tier with ``admit: reuse`` takes a dirty block only
once its key was wanted ``min_reuse`` times (offered for storing, or hit in the CPU tier) (:class:`AdmissionFilter`); a block
no tier admits stops being dirty, like a refused one. Stats per tier add blocks admitted and
refused, write amplification (bytes written per byte later read) and, with
``endurance_tbw``, the drive's projected life at the write rate seen so far. A tier with
``admit: budget`` takes a block only once its reuse clears the threshold its
:class:`~kvtier.policies.write_budget.WriteBudget` sets (ticked each step, told each job's
bytes), and adds the budget's figures to its stats.

**Miss causes** (optional, :mod:`kvtier.manager.causes`): each lookup answered ``False`` for
want of the block, each failed read from below and each read with no CPU row is counted as a
miss under one cause, from what the tiers say (a filter, an outage, a corrupt value) or what
a bounded sketch remembers of the key (saved, evicted, refused ...), fed by the job results,
admission answers, CPU evictions and the tiers' removal events. A ``new`` miss may start a
tier's background probe for the key under another layout or namespace (``foreign``).

Both directions are bounded per step (``max_promote_bytes_per_step``,
``max_demote_bytes_per_step``) so I/O never piles up behind the scheduler. Every call is
bookkeeping; the tiers' own threads move the bytes, and their completions are polled here.

Nothing in this module names a concrete tier: the stack is whatever list it is given.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from kvtier.base import (
    Backend,
    LoadTiers,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from kvtier.config import RECEIVES, CascadeConfig
from kvtier.manager.causes import EVICTED, REFUSED, STORED, MissCauses, failure_cause
from kvtier.manager.coldqueue import ColdQueue
from kvtier.manager.single import SingleTierManager
from kvtier.metrics.histogram import LatencyHistogram
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.base import EvictionPolicy
from kvtier.tiers.base import FailureKind, SecondaryTier, TierJob, TierJobResult

__all__ = ["TierStackManager"]

logger = logging.getLogger(__name__)

#: the share of CPU blocks write_back keeps clean or free, so stores find room without waiting
CLEAN_HEADROOM_FRACTION = 0.25
#: steps without a refused store after which write_back forgets the largest refused offer
#: (the request that made it has had its chance; keeping more rows clean costs disk writes)
REFUSED_OFFER_MEMORY_STEPS = 16
#: ``_promoting`` value of a key whose read is queued but has no CPU row yet
_UNRESERVED = -1
#: keys whose miss was counted when their read ended, kept for their askers' next lookup
_MAX_MARKS = 1 << 16


@dataclass
class _TierCounters:
    """What the manager saw of one secondary tier (the tier keeps its own I/O counters)."""

    promotions: int = 0
    promoted_bytes: int = 0
    promote_failures: int = 0
    corrupt_blocks: int = 0
    demotions: int = 0
    demoted_bytes: int = 0
    demote_failures: int = 0
    demote_jobs: int = 0
    promote_jobs: int = 0


def _overrides(tier: SecondaryTier, method: str) -> bool:
    """Whether ``tier``'s class replaces the contract's default ``method``."""
    return getattr(type(tier), method) is not getattr(SecondaryTier, method)


def _job_id(result: TierJobResult) -> int:
    return result.job_id


def _jobs_done(jobs: dict[OffloadKey, int], keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """One job reading each of ``keys`` ended (``jobs``: key -> jobs still reading its row);
    the keys no job reads any more, which leave ``jobs``."""
    done = []
    for key in keys:
        left = jobs[key] - 1
        if left:
            jobs[key] = left
        else:
            del jobs[key]
            done.append(key)
    return done


class TierStackManager(SingleTierManager):
    """The CPU tier (a Backend and its policy) above an ordered list of secondary tiers.

    State beyond :class:`SingleTierManager`'s, all keyed by OffloadKey:

    * ``_promoting``: key -> CPU row of its read from below (``_UNRESERVED`` until the read
      is submitted at the end of the step); looks up ``None``;
    * ``_promote_queue``: per tier, keys whose read is not submitted yet;
    * ``_dirty``: ready CPU blocks not saved below and not being saved, a :class:`ColdQueue`
      (a set that also keeps them least recently used first, :meth:`touch` refreshing them).
      The coldest are saved first by popping its front — never by walking the policy. It
      costs about 30 bytes per dirty block, where an OrderedDict costs 120, and most blocks
      of a write_back CPU tier are dirty;
    * ``_demoting``: key -> ``saved``-tier jobs still reading its CPU row (still unsaved);
    * only with ``evicted`` tiers: ``_spill``, blocks no ``saved`` tier above a victim tier
      keeps, waiting for CPU pressure to be written to the victim tiers (a
      :class:`ColdQueue` like ``_dirty``); ``_spilling``, key ->
      victim-tier jobs still reading its row; ``_kept``, key -> the index of the highest
      ``saved`` tier known to hold it (absent: none), which decides the victim tiers it goes to.

    A key in any of these is held (:meth:`_held_otherwise`): the policy keeps it out of its
    eviction order until the last job that reads it finishes.

    Threading: the engine's scheduler thread only, like every manager.
    """

    def __init__(
        self,
        backend: Backend,
        policy: EvictionPolicy,
        tiers: Sequence[SecondaryTier],
        cascade: CascadeConfig | None = None,
        *,
        enable_events: bool = True,
        admission: Sequence[AdmissionFilter | None] | None = None,
        endurance_tbw: Sequence[float | None] | None = None,
        receives: Sequence[str] | None = None,
        causes: MissCauses | None = None,
    ):
        super().__init__(backend, policy, enable_events=enable_events, causes=causes)
        self._tiers = list(tiers)
        # -- admission (None per tier: it takes every block) --
        self._admission = list(admission) if admission is not None else [None] * len(self._tiers)
        self._endurance_tbw = list(endurance_tbw) if endurance_tbw is not None else [None] * len(self._tiers)
        #: filters that count sightings (``admit: reuse`` and ``budget`` ones)
        self._counting = [f for f in self._admission if f is not None and f.counts_sightings]
        #: (tier index, write budget) of the tiers under ``admit: budget``
        self._budgets = [(i, f.budget) for i, f in enumerate(self._admission) if f is not None and f.budget]
        #: the clock wear is measured on (a replay's trace time after use_clock), and its start
        self._wear_clock: Callable[[], float] = time.monotonic
        self._started = time.monotonic()
        # -- the cascade: "saved" tiers mirror the CPU tier, "evicted" ones take its victims --
        receives = list(receives) if receives is not None else ["saved"] * len(self._tiers)
        if len(receives) != len(self._tiers) or not set(receives) <= set(RECEIVES):
            raise ValueError(
                f"receives must name one of {', '.join(RECEIVES)} per lower tier "
                f"({len(self._tiers)}), got {receives!r}"
            )
        indexed = list(enumerate(self._tiers))
        #: (index, tier) of the mirrors and of the victim tiers, in stack order
        self._saved = [(i, tier) for i, tier in indexed if receives[i] == "saved"]
        self._victims = [(i, tier) for i, tier in indexed if receives[i] == "evicted"]
        self._is_victim = [r == "evicted" for r in receives]
        #: index of the first victim tier (len(tiers) when there is none)
        self._first_victim = self._victims[0][0] if self._victims else len(self._tiers)
        cascade = cascade or CascadeConfig()
        self._write_through = cascade.write_policy == "write_through"
        block_bytes = max(1, backend.block_size)
        self._demote_budget = max(1, cascade.max_demote_bytes_per_step // block_bytes)
        self._promote_budget = max(1, cascade.max_promote_bytes_per_step // block_bytes)
        capacity = backend.get_num_free_blocks()
        self._capacity = capacity
        self._clean_target = max(1, int(capacity * CLEAN_HEADROOM_FRACTION))
        #: new blocks of the largest store refused for want of room, lately (0: none); and
        #: the steps since the last refusal
        self._refused_offer = 0
        self._steps_since_refusal = 0
        self._promoting: dict[OffloadKey, int] = {}
        #: keys whose read found no CPU row at the end of the last step, or failed since: misses
        #: until the next step ends
        self._no_room: set[OffloadKey] = set()
        #: keys that looked up None and then missed, counted then (a read that failed, no CPU
        #: row for it): the next lookup answering False, or report behind a miss, is that
        #: miss and takes the mark; at most _MAX_MARKS, the oldest dropped (asked no more)
        self._missed_pending: dict[OffloadKey, None] = {}
        #: keys reported behind a miss (so counted) while their read was queued or in flight:
        #: that read failing is not a second miss; dropped as the read ends
        self._behind_reads: set[OffloadKey] = set()
        self._promote_queue: list[deque[OffloadKey]] = [deque() for _ in self._tiers]
        self._dirty = ColdQueue()
        self._demoting: dict[OffloadKey, int] = {}
        self._spill = ColdQueue()
        self._spilling: dict[OffloadKey, int] = {}
        self._kept: dict[OffloadKey, int] = {}
        #: job id -> (tier index, job, is_load, time.monotonic() at submission)
        self._jobs: dict[int, tuple[int, TierJob, bool, float]] = {}
        #: per tier, seconds from a job's submission to the poll that found it done (what the
        #: engine waits): reads (loads) and writes (stores)
        self._load_seconds = [LatencyHistogram() for _ in self._tiers]
        self._store_seconds = [LatencyHistogram() for _ in self._tiers]
        self._job_ids = itertools.count(1)
        self._counters = [_TierCounters() for _ in self._tiers]
        #: dirty entries the demotion choice examined since creation (a cost counter for tests)
        self.entries_visited = 0
        self.lookups = 0
        self.cpu_hits = 0
        self.misses = 0
        self._closed = False
        #: stats() once shut down (set by shutdown, just before the tiers close)
        self._final_stats: dict[str, float] | None = None
        #: with causes: the lower tiers' events, taken early to see their evictions
        self._lower_events: list[OffloadingEvent] = []
        #: the tiers that may know why they missed, and those that probe siblings (asked on
        #: a miss only; the others keep the contract's no-op defaults)
        self._explaining = {i for i, t in enumerate(self._tiers, 1) if _overrides(t, "miss_reason")}
        self._probing = [t for t in self._tiers if _overrides(t, "probe_foreign")]
        if self._causes is not None:
            self._causes.collect_new = bool(self._probing)
        for tier in self._tiers:
            wiped = tier.foreign_stored()  # asked once, causes or not: the tier lets them go
            if wiped is not None and self._causes is not None:
                self._causes.remember_foreign(wiped[1], wiped[0])

    @property
    def tiers(self) -> list[SecondaryTier]:
        """The secondary tiers, in stack order."""
        return list(self._tiers)

    # -- lookup and promotion ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self.lookups += 1
        if self._contains(key):
            self.cpu_hits += 1
            if self._counting:
                self._sighted((key,))  # a reuse; a miss is counted by the offer that follows
            return True
        if key in self._promoting:
            self._poll()  # the read may have finished since the last step
            if self._contains(key):
                return True
            return None if key in self._promoting else False
        if key in self._pending:
            return False  # being written into the CPU tier
        if key in self._no_room:
            self._missed_pending.pop(key, None)  # its miss was counted as its read ended
            return False  # no CPU row to read it into, or its read failed: until the step ends
        limit = req_context.get_state(LoadTiers)
        unknown = False
        for index, tier in enumerate(self._tiers):
            if limit is not None and tier.name not in limit.names:
                continue  # the request may not load from this tier: never asked, never read
            found = tier.lookup(key)
            if found:
                # The CPU row is reserved when the read is submitted, at the end of the step,
                # not here: making room here could evict a block that looked up True a moment
                # ago for a request whose prepare_load has not come yet.
                self._promoting[key] = _UNRESERVED
                self._promote_queue[index].append(key)
                return None
            unknown = unknown or found is None
        if unknown:
            return None  # a tier finds out by the end of the step (a remote tier asks its server)
        if key in self._missed_pending:
            del self._missed_pending[key]
            return False  # its failed read was counted, and the engine asks again
        self.misses += 1
        if self._causes is not None:
            self._classify_miss(key, limit)
        return False

    def _classify_miss(self, key: OffloadKey, limit: LoadTiers | None) -> None:
        """Count the miss of ``key`` (no tier it may load from holds it) under its cause.

        A tier the request may not load from that holds it: ``filtered``. A tier that knows
        why it has not (its server is down, its read found it corrupt): that reason. Else
        what the sketch remembers of the key (``new`` if nothing), decided at the step's end
        with the step's other misses, when a ``new`` one starts the probing tiers' search for
        it under another layout or namespace.
        """
        causes = cast("MissCauses", self._causes)
        for index, tier in enumerate(self._tiers, start=1):
            if limit is not None and tier.name not in limit.names:
                # A remote tier would have to ask its server: the sketch says if it stored it.
                held = causes.stored_at(key) == index if tier.remote else tier.lookup(key) is True
                if held:
                    causes.count("filtered", index)
                    return
                continue
            reason = tier.miss_reason(key) if index in self._explaining else None
            if reason is not None:
                cause, part = failure_cause(reason)
                if cause != "evicted":
                    causes.count(cause, index, part)
                    return
        causes.missed.append(key)  # the sketch decides, with the step's other misses

    def missed_behind(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` come after a miss in their request's prefix (see
        :meth:`SingleTierManager.missed_behind`): each is a miss, ``behind`` where a tier holds
        it (the CPU tier, or the first tier below that does; a remote tier, where the sketch
        saw it stored there: its server is not asked), else under the cause its lookup would
        have had."""
        causes = self._causes
        if causes is None or not keys:
            return
        marks = self._missed_pending
        if marks:  # counted already, as the read that failed or found no row
            keys = [key for key in keys if key not in marks or marks.pop(key)]  # pop: None
        self.misses += len(keys)
        contains, pending, promoting = self._contains, self._pending, self._promoting
        local = [(index, tier) for index, tier in enumerate(self._tiers, start=1) if not tier.remote]
        remote = {index for index, tier in enumerate(self._tiers, start=1) if tier.remote}
        rest = []
        for key in keys:
            if contains(key) or key in pending or key in promoting:
                causes.count("behind", 0)
                if key in promoting:
                    self._behind_reads.add(key)
                continue
            holder = next((index for index, tier in local if tier.lookup(key) is True), None)
            if holder is None:
                rest.append(key)
            else:
                causes.count("behind", holder)
        if remote and rest:
            records = causes.records_now(rest)
            kept = []
            for key, record in zip(rest, records.tolist()):
                if record >> 5 == STORED and record & 31 in remote:
                    causes.count("behind", record & 31)
                else:
                    kept.append(key)
            rest = kept
        causes.missed.extend(rest)

    def _mark_counted(self, keys: Iterable[OffloadKey]) -> None:
        """``keys``' misses are counted: their askers' next lookups are not misses again."""
        marks = self._missed_pending
        marks.update(dict.fromkeys(keys))
        while len(marks) > _MAX_MARKS:
            del marks[next(iter(marks))]

    def is_promoting(self, key: OffloadKey) -> bool:
        """Whether a read of ``key`` from a lower tier is queued or in flight.

        Such a key looks up ``None`` until the read lands. Any other ``None`` means a tier
        cannot tell yet whether it holds the block (a remote tier asks its server at the end
        of the step), which an engine may treat differently: the block may not exist.
        """
        return key in self._promoting

    def _reserve_rows(self, count: int) -> list[int]:
        """Up to ``count`` CPU rows, evicting clean blocks if need be (end of step only)."""
        backend = self._backend
        # not that many evictable: take what there is
        shortfall = min(count - backend.get_num_free_blocks(), self._policy.evictable_blocks())
        if shortfall > 0:
            self._evict(shortfall, [])
        return backend.allocate_block_ids(min(count, backend.get_num_free_blocks()))

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._counting:
            self._sighted(keys)
        promoting = self._promoting
        if promoting:  # coming up from below already: present, like a block being written
            keys = [key for key in keys if key not in promoting]
        out = super().prepare_store(keys, req_context)
        if out is None:
            self._note_refused(keys)
        elif self._refused_offer and len(out.keys_to_store) >= self._refused_offer:
            self._refused_offer = 0  # an offer that large fits now
        return out

    def _note_refused(self, keys: Collection[OffloadKey]) -> None:
        """A store of ``keys`` found too few clean rows: write_back raises its clean target to
        the offer's new blocks (see :meth:`_clean_goal`), else an offer larger than the
        headroom would be refused for ever while every other row stays dirty."""
        contains, pending = self._contains, self._pending
        new = sum(1 for key in dict.fromkeys(keys) if key not in pending and not contains(key))
        self._refused_offer = max(self._refused_offer, new)
        self._steps_since_refusal = 0

    def _clean_goal(self) -> int:
        """Rows write_back keeps clean or free: the base headroom, or the largest offer refused
        lately if larger (never more than the tier holds)."""
        if self._refused_offer:
            self._steps_since_refusal += 1
            if self._steps_since_refusal > REFUSED_OFFER_MEMORY_STEPS:
                self._refused_offer = 0
        return max(self._clean_target, min(self._capacity, self._refused_offer))

    def _on_ready(self, keys: list[OffloadKey]) -> Collection[OffloadKey]:
        # A stored block is dirty unless every tier below already has it (say, it was
        # evicted from the CPU tier earlier and recomputed by the engine since). A dirty
        # block is held from the start: the policy never puts it in its eviction order.
        if not self._tiers:
            return ()
        if self._victims:
            return self._on_ready_cascade(keys)
        if len(self._tiers) == 1:
            lookup = self._tiers[0].lookup
            new = [key for key in keys if lookup(key) is not True]
        else:
            tiers = self._tiers
            new = [key for key in keys if not all(tier.lookup(key) is True for tier in tiers)]
        self._dirty.add_new(new)
        return keys if len(new) == len(keys) else set(new)

    def _on_ready_cascade(self, keys: list[OffloadKey]) -> Collection[OffloadKey]:
        """:meth:`_on_ready` of a stack with victim tiers: a key some ``saved`` tier lacks is
        dirty; else one that a victim tier lacks, with no ``saved`` tier above that victim
        keeping it, waits in the spill queue."""
        kept_by = self._kept
        none = len(self._tiers)
        new_dirty, new_spill = [], []
        for key in keys:
            kept, missing = none, False
            for index, tier in self._saved:  # in stack order: the first found is the highest
                if tier.lookup(key) is True:
                    kept = min(kept, index)
                else:
                    missing = True
            if missing:
                new_dirty.append(key)
            elif any(index < kept and tier.lookup(key) is not True for index, tier in self._victims):
                new_spill.append(key)
            else:
                continue
            if kept != none:
                kept_by[key] = kept
        self._dirty.add_new(new_dirty)
        self._spill.add_new(new_spill)
        return set(new_dirty).union(new_spill)

    def _held_otherwise(self, key: OffloadKey) -> bool:
        return key in self._dirty or key in self._demoting or key in self._spill or key in self._spilling

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys)
        self._recent(keys)

    def _recent(self, keys: Collection[OffloadKey]) -> None:
        self._dirty.refresh(keys)
        self._spill.refresh(keys)

    # -- the step ----------------------------------------------------------------------------

    def on_schedule_end(self) -> None:
        if not self._tiers:
            return
        self._no_room.clear()
        self._poll()
        for _, budget in self._budgets:
            budget.tick()
        self._submit_promotions()
        self._submit_demotions()
        causes = self._causes
        if causes is not None:
            if self._probing:
                for key in causes.take_new():  # is it there under another layout or namespace?
                    for tier in self._probing:
                        tier.probe_foreign(key)
            else:
                causes.step_end()
        for tier in self._tiers:
            tier.on_schedule_end()
        self._note_lower_events()
        if causes is not None:
            found = causes.found_foreign
            for index, tier in enumerate(self._tiers, start=1):
                for key, part in tier.foreign_found():
                    found(key, part, index)

    def _poll(self) -> None:
        now = time.monotonic()
        for tier in self._tiers:
            results = tier.get_finished_jobs()
            if len(results) > 1:
                # In submission order, not completion order: a step's save and read finish in
                # either order on the tier's threads, and folding them in decides which blocks
                # are newest, so eviction would depend on thread timing.
                results.sort(key=_job_id)
            for result in results:
                index, job, is_load, submitted = self._jobs.pop(result.job_id)
                if is_load:
                    self._load_seconds[index].observe(now - submitted)
                    self._finish_promotion(index, job, result)
                else:
                    self._store_seconds[index].observe(now - submitted)
                    self._finish_demotion(index, job, result)

    def _submit_promotions(self) -> None:
        budget = self._promote_budget
        for index, queue in enumerate(self._promote_queue):
            if not queue or budget <= 0:
                continue
            rows = self._reserve_rows(min(budget, len(queue)))
            if not rows:
                if not self._demoting and not self._spilling:
                    # Every CPU row is held and nothing being saved will free one: waiting
                    # would never end, so these reads become misses — for the whole next
                    # step, or the engine's next lookup would only queue them again.
                    for key in queue:
                        del self._promoting[key]
                    self._no_room.update(queue)
                    # misses: the CPU tier could not take them (but those counted already,
                    # behind their request's first miss)
                    uncounted = len(queue) - len(self._behind_reads.intersection(queue))
                    self._behind_reads.difference_update(queue)
                    self.misses += uncounted
                    if self._causes is not None:
                        self._causes.count("store_failed", 0, n=uncounted)
                        self._mark_counted(queue)
                    queue.clear()
                continue  # else blocks being saved below free rows soon: try next step
            keys = tuple(queue.popleft() for _ in range(len(rows)))
            budget -= len(keys)
            for key, row in zip(keys, rows):
                self._promoting[key] = row
            job = TierJob(next(self._job_ids), keys, tuple(rows))
            self._jobs[job.job_id] = (index, job, True, time.monotonic())
            self._counters[index].promote_jobs += 1
            self._tiers[index].submit_load(job)

    def _finish_promotion(self, index: int, job: TierJob, result: TierJobResult) -> None:
        counters = self._counters[index]
        ok = list(result.ok)
        rows = [self._promoting.pop(key) for key in ok]
        behind = self._behind_reads
        if behind:
            behind.difference_update(ok)
        if ok:
            self._policy.insert(ok, rows)  # clean: a tier below holds it
            counters.promotions += len(ok)
            counters.promoted_bytes += result.nbytes
            if self._events is not None:
                backend = self._backend
                self._events.append(OffloadingEvent(ok, backend.block_size, backend.medium, False))
        failed = list(result.failed)
        if failed:
            # The row may hold partial or unverified bytes: never serve it, free it.
            self._backend.free_block_ids([self._promoting.pop(key) for key in failed])
            # A miss for the rest of the step: a failure polled at the end of a step would
            # otherwise be queued again by the next lookup, and a read that keeps failing
            # slower than a step (a dying disk's EIO) would answer None for ever.
            self._no_room.update(failed)
            counters.promote_failures += len(failed)
            counters.corrupt_blocks += sum(
                1 for reason in result.failed.values() if reason.kind is FailureKind.CORRUPT
            )
            reasons = result.failed
            if behind:  # counted already, as blocks behind their request's first miss
                reasons = {key: reason for key, reason in reasons.items() if key not in behind}
                behind.difference_update(failed)
            self.misses += len(reasons)  # the lookup that queued each read said None, not False
            if self._causes is not None:
                self._causes.read_failed(reasons, index + 1)
                self._mark_counted(failed)

    def _submit_demotions(self) -> None:
        if not self._dirty and not self._spill:
            return
        budget = self._demote_budget - len(self._demoting) - len(self._spilling)
        if budget <= 0:
            return  # the tiers are still busy with earlier steps' writes
        deficit = 0  # clean rows missing from the headroom write_back keeps
        if self._spill or not self._write_through:
            headroom = self._backend.get_num_free_blocks() + self._policy.evictable_blocks()
            deficit = self._clean_goal() - headroom
        if self._spill and deficit > 0:
            # Blocks already past every saved tier go first: writing them to the victim
            # tiers frees rows without another step's wait.
            keys = self._pop_coldest(self._spill, min(budget, deficit))
            budget -= len(keys)
            deficit -= len(keys)
            self._submit_spill(keys)
        if not self._dirty or budget <= 0:
            return
        if not self._write_through:
            if deficit <= 0:
                return
            budget = min(budget, deficit)
        # The front of _dirty's order is the coldest block (write_back saves those first, so
        # they become the clean victims); write_through saves in the same order, soon after
        # store.
        self._demote(self._pop_coldest(self._dirty, budget))

    def _pop_coldest(self, queue: ColdQueue, count: int) -> list[OffloadKey]:
        """Take up to ``count`` of the coldest keys out of ``queue``, counting the visit."""
        keys, visited = queue.pop_coldest(count)
        self.entries_visited += visited
        return keys

    def _demote(self, keys: list[OffloadKey]) -> None:
        """Submit one store job per ``saved`` tier for ``keys`` (taken out of ``_dirty`` by
        the caller).

        Each tier gets the keys its admission filter takes; a key no tier takes is done with
        at once (like a block every tier refused): released unless a read pins it, or spilled.
        """
        if not keys:
            return
        demoting = self._demoting
        per_tier = [(index, self._admitted(index, keys)) for index, _ in self._saved]
        for _, taken in per_tier:
            for key in taken:
                demoting[key] = demoting.get(key, 0) + 1  # still held: each job reads the row
        for key in keys:
            if key not in demoting:
                self._saved_done(key)
        self._submit_stores(per_tier)

    def _submit_spill(self, keys: list[OffloadKey]) -> None:
        """Submit one store job per victim tier for ``keys`` (taken out of ``_spill``): each
        victim tier gets those no ``saved`` tier above it keeps, that its filter admits."""
        if not keys:
            return
        none, kept_by, spilling = len(self._tiers), self._kept, self._spilling
        kept = [kept_by.pop(key, none) for key in keys]
        per_tier = []
        for index, _ in self._victims:
            taken = self._admitted(index, [key for key, k in zip(keys, kept) if index < k])
            for key in taken:
                spilling[key] = spilling.get(key, 0) + 1
            per_tier.append((index, taken))
        holds, release = self._holds, self._policy.release
        for key in keys:
            if key not in spilling and key not in holds:
                release(key)
        self._submit_stores(per_tier)

    def _submit_stores(self, per_tier: list[tuple[int, list[OffloadKey]]]) -> None:
        get = self._get
        for index, taken in per_tier:
            if not taken:
                continue
            rows = cast("tuple[int, ...]", tuple(get(key) for key in taken))  # each key is held
            job = TierJob(next(self._job_ids), tuple(taken), rows)
            self._jobs[job.job_id] = (index, job, False, time.monotonic())
            self._counters[index].demote_jobs += 1
            self._tiers[index].submit_store(job)

    def _saved_done(self, key: OffloadKey) -> None:
        """Every ``saved`` tier saved, refused or skipped ``key``: spill it if a victim tier
        has no ``saved`` tier above it keeping the block, else let it go (unless pinned)."""
        if self._first_victim < self._kept.get(key, len(self._tiers)):
            self._spill.add_new((key,))
            return
        self._kept.pop(key, None)
        if key not in self._holds:
            self._policy.release(key)

    # -- admission ---------------------------------------------------------------------------

    def _sighted(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` were wanted: offered (computed), or hit in the CPU tier. A lookup that
        misses is not counted: the engine offers the block it then computes, and one request
        must count once."""
        for admission in self._counting:
            record = admission.record
            for key in keys:
                record(key)

    def _admitted(self, index: int, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` tier ``index`` takes."""
        admission = self._admission[index]
        if admission is None:
            return keys
        taken = [key for key in keys if admission.admit(key)]
        if self._causes is not None and len(taken) != len(keys):
            admitted = set(taken)
            self._causes.remember([key for key in keys if key not in admitted], REFUSED, index + 1)
        return taken

    def _admission_stats(self, index: int, counters: _TierCounters) -> dict[str, int | float]:
        """Admission and wear figures of tier ``index``; every value a number (metrics export
        them as gauges), so a ratio with nothing to divide by yet is left out."""
        admission = self._admission[index]
        written, read = counters.demoted_bytes, counters.promoted_bytes
        figures: dict[str, int | float] = {
            "admitted_blocks": counters.demotions if admission is None else admission.admitted,
            "refused_blocks": 0 if admission is None else admission.refused,
            "bytes_written": written,
            "bytes_read_later": read,
        }
        if read:
            # bytes written per byte ever read back: 1.0 would mean no write was wasted
            figures["write_amplification"] = round(written / read, 3)
        if admission is not None and admission.budget is not None:
            # the budget projects the life itself (from endurance_tbw where given), over its
            # window: one life per tier, not a second one averaged since start
            figures.update(admission.budget.stats())
            return figures
        tbw = self._endurance_tbw[index]
        seconds = self._wear_clock() - self._started
        if tbw is not None and written and seconds > 0:  # no rate before any time has passed
            rate = written / seconds  # bytes per second
            figures["projected_life_days"] = round(tbw * 1e12 / rate / 86400, 1)
        return figures

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Drive the tiers' write budgets by ``clock`` (seconds) instead of the wall clock,
        and count only the tiers' own writes: ``kvtier replay`` passes its trace's time, where
        a budget in bytes per second means what it would in the trace's deployment (the
        drive's counter runs on wall time, which a replay compresses). A fractional
        ``min_reuse`` draws by it too, so a replay on the trace's clock repeats, and
        ``projected_life_days`` takes its write rate from it."""
        for _, budget in self._budgets:
            budget.use_clock(clock, count_device=False)
        for admission in self._counting:
            admission.clock = clock  # the draw of a fractional min_reuse
        self._wear_clock, self._started = clock, clock()  # projected_life_days too

    def _finish_demotion(self, index: int, job: TierJob, result: TierJobResult) -> None:
        counters = self._counters[index]
        admission = self._admission[index]
        if admission is not None and admission.budget is not None:
            admission.budget.wrote(result.nbytes)
        counters.demotions += len(result.ok)
        counters.demoted_bytes += result.nbytes
        counters.demote_failures += len(result.failed)
        causes = self._causes
        if causes is not None:
            causes.remember(result.ok, STORED, index + 1)
            if result.failed:
                causes.store_failed(result.failed, index + 1)
        if self._is_victim[index]:
            holds, release = self._holds, self._policy.release
            for key in _jobs_done(self._spilling, job.keys):
                if key not in holds:  # saved below, or refused: the CPU tier may drop it
                    release(key)
            return
        if self._victims and result.ok:
            kept_by = self._kept
            for key in result.ok:
                if index < kept_by.get(key, len(self._tiers)):
                    kept_by[key] = index
        saved_done = self._saved_done
        for key in _jobs_done(self._demoting, job.keys):
            # Saved by every tier, or refused by some (a tier that failed the job would not
            # take it now): either way the CPU tier may drop it, once no read pins it — or
            # once a victim tier has it, if no saved tier above that one keeps it.
            saved_done(key)

    # -- lifecycle ---------------------------------------------------------------------------

    def take_events(self) -> Iterator[OffloadingEvent]:
        own = list(super().take_events())
        self._note_lower_events()
        own.extend(self._lower_events)
        self._lower_events = []
        for tier in self._tiers:
            own.extend(tier.take_events())
        return iter(own)

    def _note_lower_events(self) -> None:
        """With causes: take the lower tiers' events now (kept for :meth:`take_events`) and
        remember each block a tier removed as evicted by it, whoever takes events when."""
        causes = self._causes
        if causes is None:
            return
        remember = causes.remember
        for index, tier in enumerate(self._tiers, start=1):
            events = tier.take_events()
            if not events:
                continue
            self._lower_events.extend(events)
            for event in events:
                if event.removed and not event.metadata_only:
                    remember(event.keys, EVICTED, index)

    def _drain(self) -> None:
        for tier in self._tiers:
            tier.drain_jobs()
        self._poll()

    def reset_cache(self) -> None:
        """Wait for in-flight I/O, then forget the CPU tier; what the tiers below hold stays."""
        self._drain()
        rows = [row for row in self._promoting.values() if row is not _UNRESERVED]
        self._promoting.clear()
        for queue in self._promote_queue:
            queue.clear()
        self._dirty.clear()
        self._demoting.clear()
        self._spill.clear()
        self._spilling.clear()
        self._kept.clear()
        super().reset_cache()  # clears holds, pending and ready blocks
        self._backend.free_block_ids(rows)

    def flush(self) -> None:
        """Save every dirty CPU block below and wait for it (blocks; for shutdown).

        Victim tiers are sent every block waiting for them too, as if the CPU tier evicted it.
        """
        while self._dirty or self._demoting or self._spill or self._spilling:
            before = self._unsaved()
            keys = list(self._dirty)
            self._dirty.clear()
            self._demote(keys)
            keys = list(self._spill)
            self._spill.clear()
            self._submit_spill(keys)
            self._drain()
            if self._unsaved() == before:
                # The tiers are idle and nothing they finished changed what is left: saves
                # counted with no job behind them, or jobs whose results were taken and never
                # folded in (a call cut short by a signal's exception: between its bookkeeping
                # and its submit, or in the middle of a poll). They would otherwise keep this
                # loop, and shutdown, going for ever.
                logger.warning(
                    "kvtier: %d blocks were being saved by jobs that no longer report (%d "
                    "jobs); shutting down without them",
                    len(self._demoting) + len(self._spilling),
                    len(self._jobs),
                )
                break

    def _unsaved(self) -> tuple[int, int, int, int]:
        return len(self._dirty), len(self._demoting), len(self._spill), len(self._spilling)

    def shutdown(self) -> None:
        """Save what only the CPU tier holds, then close every tier (blocks).

        :meth:`stats` answers with the figures as they were once everything was saved, just
        before the tiers closed (what the shutdown wrote included).
        """
        if not self._closed:
            self.flush()
            self._final_stats = self.stats()
            for tier in self._tiers:
                tier.close()
        self._closed = True
        super().shutdown()

    # -- introspection -------------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        """Whether reads or writes are queued or in flight (keep stepping to finish them)."""
        return bool(self._jobs) or any(self._promote_queue)

    def stats(self) -> dict[str, float]:
        """The CPU tier's block counts, then per secondary tier ``<name>.<counter>``."""
        if self._final_stats is not None:
            return dict(self._final_stats)  # shut down: the tiers are closed
        figures = super().stats()
        figures.update(
            lookups=self.lookups,
            cpu_hits=self.cpu_hits,
            misses=self.misses,
            # held until a tier below takes them (or refuses): mirrors' and victim tiers'
            dirty_blocks=len(self._dirty) + len(self._demoting) + len(self._spill) + len(self._spilling),
            # of those, the ones waiting for, or being written to, victim tiers
            spill_blocks=len(self._spill) + len(self._spilling),
            # rows held by reads from below (queued reads hold none yet)
            promoting_blocks=len(self._promoting) - sum(map(len, self._promote_queue)),
            demoting_blocks=len(self._demoting) + len(self._spilling),
        )
        for index, (tier, counters, queue) in enumerate(
            zip(self._tiers, self._counters, self._promote_queue)
        ):
            prefix = tier.name + "."
            for name, value in vars(counters).items():
                figures[prefix + name] = value
            for name, value in self._admission_stats(index, counters).items():
                figures[prefix + name] = value
            figures[prefix + "queued_promotions"] = len(queue)
            figures[prefix + "load_jobs_in_flight"] = 0
            figures[prefix + "store_jobs_in_flight"] = 0
            figures[prefix + "blocks"] = tier.num_blocks()
            for name, value in tier.stats().items():
                figures.setdefault(prefix + name, value)
        for index, _, is_load, _ in tuple(self._jobs.values()):  # a scrape reads it from another thread
            figures[
                self._tiers[index].name + (".load_jobs_in_flight" if is_load else ".store_jobs_in_flight")
            ] += 1
        return figures

    def job_seconds(self) -> dict[tuple[str, str], LatencyHistogram]:
        """Per (tier name, ``load`` or ``store``), the latency histogram of the tier's jobs:
        from submission to the end-of-step poll that found each done. Live objects, read by
        the metrics exporter (see :mod:`kvtier.metrics`); not part of the flat :meth:`stats`."""
        out = {}
        for tier, loads, stores in zip(self._tiers, self._load_seconds, self._store_seconds):
            out[(tier.name, "load")] = loads
            out[(tier.name, "store")] = stores
        return out

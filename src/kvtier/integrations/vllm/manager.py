"""kvtier's manager seen through vLLM 0.33's ``OffloadingManager`` API.

vLLM's offloading connector (``OffloadingConnectorScheduler``) calls the manager from the
engine's scheduler thread, holding ``manager.lock`` across each step. kvtier's managers keep
the contract revision before 0.33 (``lookup -> True / False / None``, kvtier's own spec and
event types); :class:`KvtierOffloadingManager` translates each call, and adds what 0.33 asks
beyond it (load sources, cache-reset fencing, statistics, config info).

kvtier's ``None`` has two meanings, and they map to vLLM's two deferred answers. A key whose
promotion from a lower tier is queued or in flight is ``HIT_PENDING``; a key no tier can
answer for yet — a remote tier (Valkey) asks its server at the end of the step, and the block
may not be there — is ``RETRY``. The facts behind it, in vLLM 0.33's
``kv_connector/v1/offloading/scheduler.py`` and ``kv_offload/tiering/manager.py``:

* both make the connector defer the request (``get_num_new_matched_tokens`` answers ``None``
  and the scheduler asks again next step), so no unready block is ever loaded either way;
* the sliding-window lookup counts ``HIT_PENDING`` toward the window it needs and stops once
  it has one, while ``RETRY`` resets the streak and keeps scanning further back. For a block
  being promoted, that scan would start disk reads of chunks the request will never load;
  for a block whose existence is unknown, counting it as a hit could end the scan on a
  window that is not there, and the scan further back asks the server about the rest in the
  same step;
* vLLM's own tiering manager answers the same way: ``HIT_PENDING`` once it has started a
  promotion, ``RETRY`` while an asynchronous existence check runs. kvtier's disk tiers index
  every block in memory and never answer "unknown"; its Valkey tier does.

A promotion that fails verification (a corrupt block) turns into ``MISS`` at the next lookup,
which the deferred request makes.

A block whose store into the CPU tier is in flight is ``HIT_PENDING`` too, as 0.33's contract
and its CPU manager say (kvtier's own managers answer ``False``: not readable). The request
waits for the store, which the worker finishes within a step or two, and loads the block
instead of computing it again; a store that fails makes it ``MISS`` at the next lookup.

A request's ``kv_load_tiers`` (vLLM's ``ReqContext.load_tier_filter``) becomes kvtier's
:class:`~kvtier.base.LoadTiers` on its first lookup: every lower tier is a ``STORAGE``
medium, ``REMOTE`` if it says so (Valkey), else ``LOCAL``. A tier the filter leaves out is
never asked, so a block only it holds is ``MISS``; the CPU tier answers every request, as
vLLM's primary tier does.

While a request waits for promotions, the blocks it already found in the CPU tier are pinned
on its behalf (a hold, as ``prepare_load`` takes), until its lookups resolve or it finishes.
Without that, a request whose hit is larger than the CPU tier's clean room never resolves:
each step's promotions evict the blocks promoted for it a step before, which then need
promoting again (seen with vLLM's connector driving a small CPU tier). With the pins, the
found prefix only grows. A read kvtier drops for want of a CPU row answers ``False`` (MISS)
for the next step (``TierStackManager`` keeps it from being queued again), so the request
goes ahead with the prefix it has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import base as kvtier_base
from kvtier.integrations.vllm.metrics import MetricDeltas
from kvtier.manager.single import SingleTierManager
from kvtier.metrics.exporter import job_seconds_of
from kvtier.mediums import BlockIDsLoadStoreSpec
from kvtier.worker.failures import FailedRowMarks

__all__ = ["STATS_METRIC", "KvtierOffloadingManager", "stats_to_vllm", "to_vllm_event"]

# Under vLLM's logger tree, so the lines show in `vllm serve`'s log at its configured level.
logger = logging.getLogger("vllm.kvtier")

#: the Prometheus gauge mirroring kvtier's statistics, one series per figure (label ``stat``)
STATS_METRIC = "vllm:kv_offload_kvtier_stat"
#: kvtier's CPU tier medium; every other kvtier medium is a disk (vLLM's STORAGE)
_CPU_MEDIUM = "CPU"


def to_vllm_event(event: kvtier_base.OffloadingEvent, locality: Any = None) -> OffloadingEvent:
    """One kvtier event as vLLM's: kvtier's CPU tier is ``Medium.CPU``, its disks ``STORAGE``;
    a failed store's retraction stays ``metadata_only`` (vLLM publishes no removal for it)."""
    medium = Medium.CPU if event.medium == _CPU_MEDIUM else Medium.STORAGE
    return OffloadingEvent(
        keys=list(event.keys),
        medium=medium,
        removed=event.removed,
        locality=locality,
        metadata_only=event.metadata_only,
    )


def stats_to_vllm(
    figures: Mapping[str, int | float], metric: str = STATS_METRIC, prefix: tuple[str, ...] = ()
) -> OffloadingConnectorStats:
    """kvtier's statistics as gauges of ``metric``, label values ``prefix + (name,)``.

    Gauges rather than counters: kvtier's figures are totals since start, and a gauge set to a
    total stays right whatever the gaps between two reports (``rate()`` works on it as well).
    """
    stats = OffloadingConnectorStats()
    for name, value in figures.items():
        stats.set_gauge(metric, value, (*prefix, name))
    return stats


class _RequestWait:
    """Per request, in its ReqContext: what its lookups saw while it waits for promotions.

    ``step``: the step of the lookups below; ``hits``: keys found ready in that step before any
    pending answer (pinned as soon as one comes); ``pending``: keys answered HIT_PENDING or RETRY
    in that step (so ``deferred`` is ``bool(pending)``); ``pinned``: keys this manager holds for the
    request; ``promoted``: keys whose lookup started a read from disk (for get_load_source).
    """

    __slots__ = ("hits", "pending", "pinned", "promoted", "step")

    def __init__(self) -> None:
        self.step = -1
        self.hits: list[OffloadKey] = []
        self.pending: set[OffloadKey] = set()
        self.pinned: set[OffloadKey] = set()
        self.promoted: set[OffloadKey] = set()

    @property
    def deferred(self) -> bool:
        return bool(self.pending)


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's OffloadingManager over a kvtier manager (one CPU tier, maybe disk tiers below).

    Who calls it: vLLM's connector scheduler, on the engine's scheduler thread, holding
    :attr:`lock` (a no-op here: nothing else enters this manager, and kvtier's disk threads
    only hand results over when polled from this thread). No method blocks on I/O except
    :meth:`reset_cache` (waits for disk jobs in flight) and :meth:`shutdown` (saves what only
    the CPU tier holds, then closes the disk tiers).

    ``inner`` is what :func:`kvtier.build_manager` made; ``events`` says whether vLLM
    publishes KV events (kvtier's events are drained either way, so none pile up);
    ``config_info`` is the label mapping for ``vllm:kv_offload_config_info``;
    ``failed_rows`` the marks through which workers fail a store (see
    :mod:`kvtier.worker.failures`), owned (closed) by this manager.
    """

    def __init__(
        self,
        inner: SingleTierManager,
        *,
        events: bool,
        config_info: Mapping[str, str | int | float | bool],
        stats_log_interval_s: float,
        failed_rows: FailedRowMarks | None = None,
    ):
        self._inner = inner
        # Workers mark the rows of stores that failed on their rank (vLLM acknowledges only
        # successes); complete_store turns those blocks into failed stores. Rows by key of
        # every store between prepare_store and complete_store.
        self._failed_rows = failed_rows
        self._storing: dict[OffloadKey, int] = {}
        self._events = events
        self._config_info = dict(config_info)
        self._has_lower_tiers = bool(getattr(inner, "tiers", ()))
        # Set by reset_cache until on_reset_flushed: a worker may still write CPU rows freed by
        # the reset (a late DMA of a job in flight at the reset), so no disk read may fill one
        # meanwhile. Held lookups answer from the CPU tier alone and start nothing.
        self._promotions_held = False
        self._contains_cpu = inner.policy.contains
        # Tells a promotion (HIT_PENDING) from "a tier cannot tell yet" (RETRY) for a lookup
        # that answered None; a manager without lower tiers never answers None.
        self._is_promoting = getattr(inner, "is_promoting", None)
        self._stats_log_interval_s = stats_log_interval_s
        self._next_stats_log = time.monotonic() + stats_log_interval_s
        #: scheduler steps ended so far (on_schedule_end calls)
        self._step = 0
        #: requests holding pins while they wait for promotions, by request id
        self._waiting: dict[str, ReqContext] = {}
        self._closed = False
        # kvtier's metrics under their own names: what was reported, so each get_stats sends
        # increments (vLLM adds them up)
        self._deltas = MetricDeltas()
        self._job_seconds = job_seconds_of(inner)

    @property
    def inner(self) -> SingleTierManager:
        """The kvtier manager (for its ``stats()``, ``tiers`` and tests)."""
        return self._inner

    # -- lookups and loads -------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._promotions_held:
            return LookupResult.HIT if self._contains_cpu(key) else LookupResult.MISS
        if (
            req_context.load_tier_filter is not TierFilter.ALL
            and self._has_lower_tiers
            and req_context.get_state(kvtier_base.LoadTiers) is None
        ):
            req_context.set_state(self._load_tiers(req_context.load_tier_filter))
        found = self._inner.lookup(key, req_context)
        if found is False:
            # Found but not readable yet: HIT_PENDING (see the module docstring). No pins: they
            # guard a request's hits against the promotions it waits for, and a store in
            # flight evicts nothing more.
            return LookupResult.HIT_PENDING if self._inner.is_storing(key) else LookupResult.MISS
        wait = req_context.get_state(_RequestWait)
        if wait is None:
            if found is True:
                return LookupResult.HIT  # the common case: no state for requests never waiting
            wait = _RequestWait()
            req_context.set_state(wait)
        if wait.step != self._step:
            wait.step, wait.hits, wait.pending = self._step, [], set()
        if found is True:
            if wait.deferred:
                self._pin([key], wait, req_context)
            else:
                wait.hits.append(key)
            return LookupResult.HIT
        promoting = self._is_promoting is None or self._is_promoting(key)
        if promoting:
            wait.promoted.add(key)
        if not wait.deferred:
            self._pin(wait.hits, wait, req_context)
            self._waiting[req_context.req_id] = req_context
        wait.pending.add(key)
        # which of the two: see the module docstring
        return LookupResult.HIT_PENDING if promoting else LookupResult.RETRY

    def _load_tiers(self, tier_filter: TierFilter) -> kvtier_base.LoadTiers:
        """vLLM's ``load_tier_filter`` (from the request's ``kv_load_tiers``) in kvtier's terms:
        the lower tiers it allows, each a ``STORAGE`` medium, ``REMOTE`` if the tier says so
        (Valkey) else ``LOCAL``. Like vLLM's tiering manager, the CPU tier is not filtered."""
        allowed = frozenset(
            tier.name
            for tier in getattr(self._inner, "tiers", ())
            if tier_filter.allows(Medium.STORAGE, Locality.REMOTE if tier.remote else Locality.LOCAL)
        )
        return kvtier_base.LoadTiers(allowed)

    def _pin(self, keys: list[OffloadKey], wait: _RequestWait, req_context: ReqContext) -> None:
        """Hold ``keys`` (ready now) for a waiting request, so promotions cannot evict them."""
        new = [key for key in keys if key not in wait.pinned]
        if new:
            self._inner.prepare_load(new, req_context)
            wait.pinned.update(new)

    def _unpin(self, req_context: ReqContext) -> None:
        wait = req_context.get_state(_RequestWait)
        self._waiting.pop(req_context.req_id, None)
        if wait is not None and wait.pinned:
            self._inner.complete_load(list(wait.pinned), req_context)
            wait.pinned.clear()

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """DISK for a key this request's lookups brought up from disk, else HOST (CPU tier)."""
        wait = req_context.get_state(_RequestWait)
        if wait is not None and key in wait.promoted:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self._inner.prepare_load(keys, req_context)
        assert isinstance(spec, BlockIDsLoadStoreSpec)  # the CPU tier's rows
        return CPULoadStoreSpec(spec.block_ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._inner.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._inner.complete_load(keys, req_context)

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self._inner.prepare_store(keys, req_context)
        if out is None:
            return None
        assert isinstance(out.store_spec, BlockIDsLoadStoreSpec)  # the CPU tier's rows
        if self._failed_rows is not None:
            self._storing.update(zip(out.keys_to_store, out.store_spec.block_ids.tolist()))
        return PrepareStoreOutput(
            keys_to_store=out.keys_to_store,
            store_spec=CPULoadStoreSpec(out.store_spec.block_ids),
            evicted_keys=out.evicted_keys,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Publish the stored blocks, except those a worker marked failed: those are
        completed as failed stores (dropped), so a row with one rank's stale shard is never
        served."""
        if self._failed_rows is None:
            self._inner.complete_store(keys, req_context, success)
            return
        storing = self._storing
        mine = [key for key in keys if key in storing]
        marked = self._failed_rows.take([storing.pop(key) for key in mine])
        failed = [key for key, bad in zip(mine, marked.tolist()) if bad]
        if not failed or not success:
            self._inner.complete_store(keys, req_context, success)
            return
        logger.warning(
            "kvtier: %d of %d stored blocks failed on a worker (logged there); dropped, "
            "they will be recomputed",
            len(failed),
            len(keys),
        )
        bad = set(failed)
        self._inner.complete_store([key for key in keys if key not in bad], req_context, True)
        self._inner.complete_store(failed, req_context, False)

    # -- requests and steps --------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        answer = self._inner.on_new_request(req_context)
        # vLLM compares the policy with its own enum; kvtier's has the same values.
        return RequestOffloadingContext(policy=OffloadPolicy(answer.policy.value))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._unpin(req_context)
        self._inner.on_request_finished(req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Release the pins of requests whose lookups resolved in this step (vLLM pinned what
        it loads with prepare_load already), then submit the step's disk reads and writes."""
        for req_context in list(self._waiting.values()):
            wait = req_context.get_state(_RequestWait)
            # looked up this step without waiting: resolved. Not looked up: still waiting.
            if wait.step == self._step and not wait.deferred:
                self._unpin(req_context)
        self._inner.on_schedule_end()
        self._step += 1
        if self._stats_log_interval_s > 0:
            now = time.monotonic()
            if now >= self._next_stats_log:
                self._next_stats_log = now + self._stats_log_interval_s
                self._log_stats("kvtier")

    def has_pending_work(self) -> bool:
        pending = getattr(self._inner, "has_pending_work", None)
        return bool(pending()) if pending is not None else False

    def take_events(self) -> Iterator[OffloadingEvent]:
        # Drained even when vLLM publishes no events: kvtier's disk tiers record theirs
        # regardless, and an undrained list would grow for the life of the engine.
        events = list(self._inner.take_events())
        if not self._events:
            return iter(())
        return iter([to_vllm_event(event) for event in events])

    # -- reset, stats, lifecycle ---------------------------------------------------------------

    def reset_cache(self) -> None:
        """Forget the CPU tier (waiting for disk jobs in flight); disk tiers keep their blocks."""
        self._inner.reset_cache()  # drops every hold, the pins of waiting requests included
        for req_context in self._waiting.values():
            req_context.get_state(_RequestWait).pinned.clear()
        self._waiting.clear()
        self._promotions_held = self._has_lower_tiers
        # vLLM skips the completion of jobs the reset fenced: their rows are free already
        self._storing.clear()

    def on_reset_flushed(self) -> None:
        self._promotions_held = False
        if self._failed_rows is not None:
            # every fenced job has been reported: no mark of theirs can still be written
            self._failed_rows.clear()

    def stats(self) -> dict[str, float]:
        """kvtier's statistics: CPU tier block counts, then ``<tier>.<figure>`` per disk tier."""
        return self._inner.stats()

    def get_stats(self) -> OffloadingConnectorStats | None:
        figures = self._inner.stats()
        stats = stats_to_vllm(figures)
        self._deltas.add_to(stats, figures, self._job_seconds())
        return stats

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        return [self._config_info]

    def _log_stats(self, when: str) -> None:
        figures = self._inner.stats()
        logger.info("%s: %s", when, " ".join(f"{k}={v}" for k, v in figures.items()))

    def shutdown(self) -> None:
        """Save what only the CPU tier holds to the disk tiers, close them, remove the region.

        Blocks for those writes. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._log_stats("kvtier at shutdown")
        self._inner.shutdown()
        if self._failed_rows is not None:
            self._failed_rows.close()

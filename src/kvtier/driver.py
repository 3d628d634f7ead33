"""One thread driving both sides of the offloading stack, the way vLLM's connector does.

:class:`StackDriver` holds a spec's manager (the scheduler side) and an
:class:`~kvtier.worker.worker.OffloadingWorker` over the engine's KV cache (the worker side)
and speaks the contract between them:

* **lookup**: a request's keys in prefix order until the first miss; a ``None`` is a block on
  its way up from a lower tier, so the driver ends a step (which submits the reads), waits for
  the tiers and asks about the whole prefix again, as vLLM's connector does step after step;
* **load**: ``prepare_load`` pins the hits, the CPU->GPU handler copies them into the engine's
  blocks, ``complete_load`` unpins them;
* **store**: ``prepare_store`` reserves CPU rows, the GPU->CPU handler copies the engine's
  blocks into them, and ``complete_store`` publishes them at the first step after the copy
  ended (the engine keeps those blocks unchanged until then).

The engine that owns the KV cache decides which of its blocks hold which key: the replay's
simulated engine (:class:`~kvtier.replay.engine.ReplayEngine`) and the transformers
integration (:mod:`kvtier.integrations.transformers`) are both drivers. Importing this module
does not import torch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.base import CanonicalKVCaches, OffloadKey, ReqContext, TransferResult
from kvtier.mediums import GPULoadStoreSpec

__all__ = ["MAX_WAIT_S", "DriverCounts", "StackDriver"]

#: how long a driver waits for pending lookups or busy tiers before giving up on them
MAX_WAIT_S = 30.0


@dataclass
class DriverCounts:
    """What a driver's copies and stores came to (the tiers' own counters are the manager's)."""

    stored_blocks: int = 0
    refused_stores: int = 0
    #: stores that found the CPU tier full of unsaved blocks and waited for the tiers
    store_waits: int = 0
    failed_transfers: int = 0
    #: the worker's finished copy jobs by direction ("store", "load"): jobs, bytes, and the
    #: seconds the copy engine measured for them (on CUDA between events on the job's stream)
    copies: dict[str, dict[str, float]] = field(
        default_factory=lambda: {d: {"jobs": 0, "bytes": 0, "seconds": 0.0} for d in ("store", "load")}
    )


class StackDriver:
    """The manager and the worker of ``spec`` (a :class:`~kvtier.spec.TieredOffloadingSpec`)
    over the engine's ``kv_caches``, driven from one thread.

    Who calls it: the engine, from the one thread that runs its requests; nothing here is
    thread-safe. :meth:`lookup_prefix` and :meth:`load` block until their answer or copy is
    there; :meth:`store` only starts its copy.
    """

    def __init__(self, spec, kv_caches: CanonicalKVCaches, counts: DriverCounts | None = None):
        from kvtier.worker.worker import OffloadingWorker

        self.manager = spec.get_manager()
        try:
            self.worker = OffloadingWorker.from_spec(spec, kv_caches)
        except BaseException:
            self.manager.shutdown()
            raise
        self.counts = counts if counts is not None else DriverCounts()
        #: store copies in flight: job id -> (keys, request context, the GPU blocks it reads)
        self._storing: dict[int, tuple[list[OffloadKey], ReqContext, list[int]]] = {}
        self._finished: dict[int, TransferResult] = {}  # handler results not yet taken
        self._job_ids = itertools.count(1)
        self.cpu_name: str = spec.config.tiers[0].name
        #: the tiers below the CPU tier, in stack order (none for a single-tier manager)
        self.lower = getattr(self.manager, "tiers", [])
        self.lower_names = [tier.name for tier in self.lower]

    # -- copies --------------------------------------------------------------------------------

    def _transfer(self, spec) -> bool:
        """Run one copy to its end (a load: the engine needs its bytes now)."""
        job_id = next(self._job_ids)
        if not self.worker.transfer_async(job_id, spec):
            return False
        self.worker.wait({job_id})
        self._collect()
        return self._finished.pop(job_id).success

    def _collect(self) -> None:
        """Take the handlers' finished jobs; complete the stores among them."""
        finished = self._finished
        for result in self.worker.get_finished():
            finished[result.job_id] = result
            if result.success:
                copies = self.counts.copies["store" if result.job_id in self._storing else "load"]
                copies["jobs"] += 1
                copies["bytes"] += result.transfer_size or 0
                copies["seconds"] += result.transfer_time or 0.0
        for job_id in [job_id for job_id in self._storing if job_id in finished]:
            keys, ctx, blocks = self._storing.pop(job_id)
            ok = finished.pop(job_id).success
            self.manager.complete_store(keys, ctx, success=ok)
            if ok:
                self.counts.stored_blocks += len(keys)
            else:
                self.counts.failed_transfers += 1
            self._copy_ended(blocks)

    def _copy_ended(self, blocks: list[int]) -> None:
        """A store copy reading the engine's ``blocks`` ended: they may change now (a hook)."""

    def wait_for_stores(self) -> None:
        """Wait for every store copy in flight and complete them."""
        if self._storing:
            self.worker.wait(set(self._storing))
            self._collect()

    def load(self, keys: list[OffloadKey], blocks: list[int], first_index: int, ctx: ReqContext) -> bool:
        """Copy ``keys`` (each looked up ``True`` in this step) into the engine's ``blocks``;
        whether the copy succeeded. ``first_index``: the position of ``keys[0]`` among the
        request's blocks."""
        manager = self.manager
        cpu_spec = manager.prepare_load(keys, ctx)
        ok = self._transfer((cpu_spec, GPULoadStoreSpec(blocks, [len(blocks)], [first_index])))
        manager.complete_load(keys, ctx)
        if not ok:
            self.counts.failed_transfers += 1
        return ok

    def store(
        self, keys: list[OffloadKey], ctx: ReqContext, blocks_of: Callable[[list[OffloadKey]], list[int]]
    ) -> list[int]:
        """Offer ``keys`` for storing and start copying those the manager takes from the engine's
        blocks (``blocks_of(keys)``); the blocks that copy reads (empty: nothing to copy).

        A CPU tier full of blocks still being saved below gets the time a real arrival gap
        would have given it (the tiers finish their saves), then one more offer; a refusal
        after that is counted and nothing is stored.
        """
        manager = self.manager
        out = manager.prepare_store(keys, ctx)
        if out is None and getattr(manager, "has_pending_work", lambda: False)():
            self.counts.store_waits += 1
            deadline = time.monotonic() + MAX_WAIT_S
            while manager.has_pending_work() and time.monotonic() < deadline:
                self.step()
                self.wait_for_tiers()
            self.step()
            out = manager.prepare_store(keys, ctx)
        if out is None:
            self.counts.refused_stores += len(keys)
            return []
        if not out.keys_to_store:
            return []
        blocks = blocks_of(out.keys_to_store)
        job_id = next(self._job_ids)
        if not self.worker.transfer_async(job_id, (GPULoadStoreSpec(blocks, [len(blocks)]), out.store_spec)):
            manager.complete_store(out.keys_to_store, ctx, success=False)
            self.counts.failed_transfers += 1
            return []
        self._storing[job_id] = (out.keys_to_store, ctx, blocks)
        return blocks

    # -- the scheduler side --------------------------------------------------------------------

    def step(self) -> None:
        """End one scheduler step: complete the finished store copies, then let the manager
        submit its queued tier jobs and take their results."""
        if self._storing:
            self._collect()
        self.manager.on_schedule_end()

    def served_by(self, key: OffloadKey) -> str:
        """The lower tier a promoted key came from: the first that holds it (the manager
        promotes from the first tier, in stack order, that has the key)."""
        for tier in self.lower:
            if tier.lookup(key):
                return tier.name
        return self.lower_names[0]

    def served(self, keys: list[OffloadKey], promoted: set[OffloadKey]) -> dict[str, int]:
        """Loaded ``keys`` counted by the tier that served them: the CPU tier's name, or for a
        key that was ``promoted`` (see :meth:`lookup_prefix`) the lower tier it came from."""
        counts: dict[str, int] = {}
        for key in keys:
            tier = self.served_by(key) if key in promoted else self.cpu_name
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    def lookup_prefix(self, keys: list[OffloadKey], ctx: ReqContext) -> tuple[int, set[OffloadKey], set[int]]:
        """How many of ``keys`` (in order) the offloading tiers can load now, which keys were
        pending (being promoted from a lower tier) at some point, and the indexes of the keys
        the manager counted as misses when it answered ``False`` (not a key another request
        was still writing, which is no miss).

        Like vLLM's connector, an answer holds only for the step it was given in: while any
        key is pending (``None``), the driver runs a step and asks about the prefix again, up
        to the key that missed (asked once: each block of the request counts once, as a hit
        or a miss). Keys already found are touched first, so the step's promotions make room
        by evicting other blocks rather than them.
        """
        manager = self.manager
        deadline = time.monotonic() + MAX_WAIT_S
        promoted: set[OffloadKey] = set()
        before: tuple | None = None
        is_promoting = getattr(manager, "is_promoting", lambda key: False)
        is_storing = getattr(manager, "is_storing", lambda key: False)
        missed: int | None = None
        counted: set[int] = set()
        while True:
            found = 0
            waiting = []
            for index, key in enumerate(keys[:missed]):
                answer = manager.lookup(key, ctx)
                if answer is False:
                    missed = index
                    if not is_storing(key):
                        counted.add(index)
                    break
                if answer is None:
                    waiting.append(key)
                    promoted.add(key)
                elif not waiting:
                    found += 1
            if not waiting or time.monotonic() >= deadline:
                return found, promoted, counted
            if found:
                manager.touch(keys[:found], ctx)
            self.step()  # submits the reads
            # The request blocks on the tiers until an answer changes, as an engine's request
            # waits in its queue: never an empty step that finds the same None again (a remote
            # tier's answers take a round trip, and stepping through it is millions of steps).
            # (a key going from "unknown" to "being promoted" is progress, though both are None)
            now = (found, len(waiting), waiting[0], sum(map(is_promoting, waiting)))
            if now == before:
                self.wait_for_tiers()  # the reads are done, no answer moved: wait for the rest
            else:
                self.wait_for_loads()
            before = now
            self.step()  # takes their results: the next scan sees the promoted blocks

    def wait_for_loads(self) -> None:
        """Block until the lower tiers finished their reads (promotions, and the reads that
        answer lookups); their saves go on meanwhile.

        A request waits for its promotions only, as in vLLM: a save queued beside the reads
        (with its flush and index commit) is not on the request's path.
        """
        for tier in self.lower:
            tier.wait_loads()

    def wait_for_tiers(self) -> None:
        """Block until the lower tiers finished what they were given (reads and saves).

        For room to store: the CPU tier is full of blocks being saved below. Blocking, not
        polling: spinning on lookups (even yielding with ``sleep(0)``) starves the tiers'
        threads of the GIL on a busy machine, and short sleeps last a scheduler tick there.
        """
        for tier in self.lower:
            tier.drain_jobs()

    def close(self) -> None:
        """Stop the handlers and the manager (the manager saves dirty CPU blocks below)."""
        self.wait_for_stores()
        self.worker.shutdown()
        self.manager.shutdown()

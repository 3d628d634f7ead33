"""An OffloadingManager over one tier: one Backend for the slots, one EvictionPolicy for the order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from itertools import chain, filterfalse, repeat
from typing import cast

from kvtier.base import (
    Backend,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvtier.errors import BlockStateError
from kvtier.manager.causes import CAUSES, EVICTED, MissCauses, speedups
from kvtier.policies.base import EvictionPolicy, tail_first

__all__ = ["SingleTierManager"]


class _RequestKeys:
    """Per request, in its ReqContext: the keys it named, for their recency at its end.

    ``chunks``: the keys of each offer, as a tuple (8 bytes a key: the key objects are
    shared, never copied), and of each load, as the dict the load made anyway; ``reused``: those it found ready and used, per
    call (a load's keys, an offer's present ones); ``finished``: ``on_request_finished``
    came (a store completing later refreshes the keys again, so the request's order holds
    for blocks that became ready after its end).
    """

    __slots__ = ("chunks", "finished", "owner", "reused")

    def __init__(self, owner: object):
        self.owner = owner
        self.chunks: list[Collection[OffloadKey]] = []
        self.reused: list[Collection[OffloadKey]] = []
        self.finished = False

    def ordered(self, req_context: ReqContext) -> Collection[OffloadKey]:
        """Every key once, head first: by the token positions vLLM's ReqContext records,
        where it has one for each key, else in the order the request named them (loads,
        then offers: prefix order unless an engine stores out of order, which is why vLLM
        records positions)."""
        chunks = self.chunks
        # one chunk (a load's dict, an offer's tuple) has each key once already
        keys: Collection[OffloadKey] = (
            chunks[0] if len(chunks) == 1 else list(dict.fromkeys(chain.from_iterable(chunks)))
        )
        position = getattr(req_context, "get_offload_key_position", None)
        if position is not None and len(keys) > 1:
            positions = [position(key) for key in keys]
            if None not in positions:
                return [key for _, key in sorted(zip(positions, keys), key=lambda pair: pair[0])]
        return keys

    def reused_keys(self, keys: Collection[OffloadKey]) -> Collection[OffloadKey]:
        """The keys the request reused, as a container (``keys``: :meth:`ordered`'s answer)."""
        reused = self.reused
        if len(reused) == 1 and len(reused[0]) == len(keys):
            only = reused[0]  # a request that only read, or only offered present keys
            return only if isinstance(only, dict) else frozenset(only)
        return set(chain.from_iterable(reused))


class _Contains:
    """``key in`` a policy whose ``contains`` is its own method (an out-of-tree policy)."""

    __slots__ = ("contains",)

    def __init__(self, contains: Callable[[OffloadKey], bool]):
        self.contains = contains

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]


#: what a finished request's context keeps once its keys are of no more use (no owner: any
#: manager that sees it starts afresh, and a late completion finds nothing to refresh)
_DONE = _RequestKeys(None)
_DONE.finished = True


class SingleTierManager(OffloadingManager):
    """Keeps blocks in one tier (the CPU tier, in a one-tier stack).

    Where each block's state lives — no per-block object, to stay near 150 bytes per block:

    * ready blocks: in the policy, ``key -> block id``; ``lookup`` is one membership test;
    * blocks being written: ``_pending``, ``key -> block id``; invisible to ``lookup``, never
      evicted, their slot owned by the writing transfer;
    * holds: ``_holds``, ``key -> reads in flight`` (pins), only for ready blocks. A subclass
      may have reasons of its own (a block not yet saved below) and says so through
      :meth:`_held_otherwise`. The policy is told when a block's first reason appears
      (:meth:`EvictionPolicy.hold`) and its last goes (``release``), so it keeps held blocks
      out of its eviction order: no slot is reused while a worker reads it, and eviction
      never walks past a held block.

    Every call costs O(keys it names + blocks it evicts), whatever the tier's size or how
    many of its blocks are held.

    **Recency as vLLM 0.33 keeps it.** vLLM's connector never calls :meth:`touch`; what a
    request used reaches the manager through its loads, its offers and its end. So each
    request's keys are remembered in its ReqContext (:class:`_RequestKeys`): keys it offers
    while they are present are refreshed at once (the GPU still has them, so they are never
    loaded, yet every later request wants them), and :meth:`on_request_finished` hands the
    policy all its keys in prefix order, with the ones it reused
    (:meth:`EvictionPolicy.request_finished`): one use each, and the head most recent. A
    store that completes after the request ended refreshes them once more, so blocks that
    became ready late do not end up newer than the head of their own prefix. Within every
    call the head of a prefix ends most recent (the policy's contract), and holds are
    released tail first for the same reason.

    The manager never waits: a single tier has nothing to promote, so ``lookup`` never says
    ``None`` and ``on_schedule_end`` has nothing to flush.

    Threading: the engine's scheduler thread only (see :class:`~kvtier.base.OffloadingManager`).
    """

    def __init__(
        self,
        backend: Backend,
        policy: EvictionPolicy,
        *,
        enable_events: bool = True,
        causes: MissCauses | None = None,
    ):
        """``causes``: count each miss under its cause (:mod:`kvtier.manager.causes`);
        None: no causes, no sketch."""
        self._backend = backend
        self._policy = policy
        self._pending: dict[OffloadKey, int] = {}
        self._holds: dict[OffloadKey, int] = {}
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        #: ready blocks dropped to make room, since start
        self.evictions = 0
        self._causes = causes
        #: run once at shutdown, before anything closes (see :meth:`add_shutdown_hook`)
        self._shutdown_hooks: list[Callable[[], None]] = []
        # Bound once: these run per key on the hot path.
        self._contains = policy.contains
        self._get = policy.get
        #: no reason to hold a block but reads: pins map one to one onto policy holds, and
        #: reads take and give them back in bulk
        self._plain_holds = type(self)._held_otherwise is SingleTierManager._held_otherwise
        if type(self).lookup is SingleTierManager.lookup:
            self.lookup = self._bound_lookup()  # type: ignore[method-assign,assignment]

    @property
    def backend(self) -> Backend:
        """The tier's Backend (its slots and spec type)."""
        return self._backend

    @property
    def policy(self) -> EvictionPolicy:
        """The tier's eviction policy."""
        return self._policy

    # -- lookups and loads -------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether ``key`` is a ready block (never ``None``: one tier has nothing to promote).

        A miss of a key nobody is writing is noted for its cause and decided later, in a
        batch (:class:`~kvtier.manager.causes.MissCauses`). The instance's ``lookup`` is the
        same logic as a closure (:meth:`_bound_lookup`): it runs once per block per request,
        the call an engine's scheduler makes most often.
        """
        if self._contains(key):
            return True
        if self._causes is not None and key not in self._pending:  # being written: not a miss
            self._causes.missed.append(key)
        return False

    def _bound_lookup(self) -> Callable[[OffloadKey, ReqContext], bool]:
        """:meth:`lookup` over this manager's containers, as a closure: it reads them as cell
        variables, with no attribute lookups, and tests the policy's index with ``in`` where
        ``contains`` is that dict's own method: less than half the method's cost (a hit 60 ns
        against vLLM's 209, docs/bench.md). Where :mod:`kvtier._speedups` was built and the
        index is a dict, the same logic as a C callable over the same containers (no Python
        frame a call: docs/design/miss-causes.md). Every container it names only changes in
        place."""
        contains, pending = self._contains, self._pending
        index = getattr(contains, "__self__", None)
        if type(index) is not dict or contains != index.__contains__:
            index = _Contains(contains)
        elif speedups is not None:
            return speedups.Lookup(index, pending, None if self._causes is None else self._causes.missed)
        if self._causes is None:

            def lookup(key: OffloadKey, req_context: ReqContext) -> bool:
                return key in index

            return lookup
        missed = self._causes.missed

        def lookup_noting(key: OffloadKey, req_context: ReqContext) -> bool:
            if key in index:
                return True
            if key not in pending:  # being written: not a miss
                missed.append(key)  # not a bound append in a cell: CPython calls this form inline
            return False

        return lookup_noting

    def missed_behind(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` come after a miss in their request's prefix: the engine stopped looking
        them up there and will compute them. Each counts as a miss (with causes on): a block
        the tier holds (or is writing) as ``behind``, any other under the cause its lookup
        would have had. An engine that reports them (``kvtier replay``) makes the causes add
        up to every block it computed; vLLM's connector does not, and counts one miss a
        request."""
        causes = self._causes
        if causes is None:
            return
        contains, pending, note = self._contains, self._pending, causes.missed.append
        held = 0
        for key in keys:
            if contains(key) or key in pending:
                held += 1
            else:
                note(key)
        if held:
            causes.count("behind", 0, n=held)

    @property
    def miss_causes(self) -> MissCauses | None:
        """The miss-cause counters and sketch (None: off)."""
        return self._causes

    def is_storing(self, key: OffloadKey) -> bool:
        """Whether ``key`` is being written into this tier (prepared, not yet completed).

        Such a key looks up ``False`` (not readable); an engine whose contract tells "being
        written" from "absent" (vLLM 0.33's ``HIT_PENDING``) asks this to tell them apart.
        """
        return key in self._pending

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        found = list(map(self._get, keys))
        if None in found:
            key = next(key for key, block_id in zip(keys, found) if block_id is None)
            raise BlockStateError(
                f"prepare_load: key {key.hex()} is not a ready block; look it up first "
                "and load only keys that looked up True in this step"
            )
        holds = self._holds
        named = dict.fromkeys(keys, 1)
        if self._plain_holds and len(named) == len(keys) and holds.keys().isdisjoint(named):
            # The common read: distinct keys no other read holds. Hold them in bulk.
            holds.update(named)
            self._policy.hold_all(named, read=True)
        else:
            held_otherwise, plain = self._held_otherwise, self._plain_holds
            first_holds = []
            for key in keys:
                count = holds.get(key, 0)
                holds[key] = count + 1
                if not count and not held_otherwise(key):
                    first_holds.append(key)
            if plain:  # every hold is a read's, so every release is (see _release)
                self._policy.hold_all(first_holds, read=True)
            else:
                hold = self._policy.hold
                for key in first_holds:
                    hold(key)
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self:
            state = _RequestKeys(self)
            req_context.set_state(state)
        # the read's dict serves as its keys and as its reused keys: no copy of either
        state.chunks.append(named)
        state.reused.append(named)
        block_ids: list[int] = found  # type: ignore[assignment]  # no None left
        return self._backend.get_load_store_spec(keys, block_ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # Tail first: a released block rejoins the order as the most recent, and the head
        # of the prefix must end newest.
        ordered = list(tail_first(keys))
        holds = self._holds
        counts = list(map(holds.pop, ordered, repeat(0)))
        if self._plain_holds and counts.count(1) == len(counts):
            # The common end of a read: distinct keys, each its only pin (a key named twice
            # would pop as 0 the second time).
            self._policy.release_all(ordered, read=True)
            return
        for key, count in zip(ordered, counts):  # put the pins back, then one at a time
            if count:
                holds[key] = count
        release = self._release
        for key in ordered:
            release(key)

    def _release(self, key: OffloadKey) -> None:
        """Drop one pin on ``key`` (a finished read)."""
        count = self._holds.get(key)
        if count is None:
            return  # held before a reset_cache: that block is gone already
        if count == 1:
            del self._holds[key]
            if self._plain_holds:
                self._policy.release_all((key,), read=True)  # held by hold_all(read=True)
            elif not self._held_otherwise(key):
                self._policy.release(key)
        else:
            self._holds[key] = count - 1

    def _held_otherwise(self, key: OffloadKey) -> bool:
        """Whether ready ``key`` must stay for a reason other than a pin (none here)."""
        return False

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        contains, pending = self._contains, self._pending
        # dict.fromkeys drops repeats within the offer, which would otherwise get two slots.
        offered = dict.fromkeys(keys)
        # Keys another request is writing already are left out; the rest split into present
        # and new ones. filter/filterfalse run the per-key loops in C.
        candidates = list(filterfalse(pending.__contains__, offered)) if pending else offered
        to_store = list(filterfalse(contains, candidates))
        present = list(filter(contains, candidates)) if len(to_store) != len(candidates) else []
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self:
            state = _RequestKeys(self)
            req_context.set_state(state)
        state.chunks.append(tuple(offered))
        if present:
            # Offered again while present: the engine's GPU still has them, so they are
            # never loaded, yet they are in use; refresh them now and count the use at the
            # request's end (vLLM 0.33 does the same).
            state.reused.append(present)
            self._policy.refresh(present)
            self._recent(present)
        backend = self._backend
        if not to_store:
            return PrepareStoreOutput([], backend.get_load_store_spec((), ()), [])

        evicted_keys: list[OffloadKey] = []
        shortfall = len(to_store) - backend.get_num_free_blocks()
        if shortfall > 0:
            evicted = self._evict(shortfall, present)
            if evicted is None:
                return None
            evicted_keys = evicted

        block_ids = backend.allocate_block_ids(len(to_store))
        pending.update(zip(to_store, block_ids))
        return PrepareStoreOutput(to_store, backend.get_load_store_spec(to_store, block_ids), evicted_keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        # ready keys, and keys from before a reset, are not pending: left alone
        found: list[int | None] = list(map(self._pending.pop, keys, repeat(None)))
        if None in found:
            done = [key for key, block_id in zip(keys, found) if block_id is not None]
            block_ids = [block_id for block_id in found if block_id is not None]
            if not done:
                return
        else:
            done, block_ids = list(keys), cast("list[int]", found)
        if success:
            held = self._on_ready(done)
            if held:
                self._policy.insert_held(done, block_ids, held)
            else:
                self._policy.insert(done, block_ids)
            if self._events is not None:
                backend = self._backend
                self._events.append(OffloadingEvent(done, backend.block_size, backend.medium, removed=False))
            state = req_context.get_state(_RequestKeys)
            if state is not None and state.finished and state.owner is self:
                # Ready after its request ended: inserted as the newest, so lay the request's
                # keys over it again, head most recent.
                keys_in_order = state.ordered(req_context)
                self._policy.refresh(keys_in_order)
                self._recent(keys_in_order)
                self._forget_if_done(state, keys_in_order, req_context)
        else:
            self._backend.free_block_ids(block_ids)
            if self._events is not None:
                # Never readable, so no stored event announced them; but an engine may have
                # kept state for them since it asked for the store (vLLM's connector does,
                # with self-describing KV events), and this event is its only cue to drop it.
                # Consumers tracking what lookup can see skip metadata_only events.
                backend = self._backend
                self._events.append(
                    OffloadingEvent(
                        done, backend.block_size, backend.medium, removed=True, metadata_only=True
                    )
                )

    def _evict(self, count: int, protected: list[OffloadKey]) -> list[OffloadKey] | None:
        """Free ``count`` slots by evicting ready blocks; the evicted keys, or ``None``.

        Never evicts a held block, nor one of ``protected`` (the ready keys of the offer being
        placed: the engine relies on the blocks it offered being present after the call).
        """
        # The policy keeps held blocks out of its order; only the offer's own ready keys
        # (a handful) are passed over.
        victims = self._policy.evict_unheld(count, set(protected) if protected else ())
        if victims is None:
            return None
        keys, block_ids = zip(*victims) if victims else ((), ())
        evicted_keys = list(keys)
        backend = self._backend
        backend.free_block_ids(list(block_ids))
        self.evictions += len(evicted_keys)
        if self._causes is not None:
            self._causes.remember(evicted_keys, EVICTED, 0)
        if self._events is not None:
            self._events.append(
                OffloadingEvent(evicted_keys, backend.block_size, backend.medium, removed=True)
            )
        return evicted_keys

    def _on_ready(self, keys: list[OffloadKey]) -> Collection[OffloadKey]:
        """``keys`` were just stored and are about to become ready: a hook for subclasses.

        Returns those of ``keys`` that must be held from the moment they are ready (none
        here); the policy then takes them straight into its held set.
        """
        return ()

    # -- requests, steps, lifecycle ------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self) -> None:
        """Nothing to submit; the miss causes' log is applied once it has grown."""
        if self._causes is not None:
            self._causes.step_end()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """One use of each key the request reused, then all its keys recent, head most recent."""
        state = req_context.get_state(_RequestKeys)
        if state is None or state.finished or state.owner is not self:
            return
        state.finished = True
        keys = state.ordered(req_context)
        self._policy.request_finished(keys, state.reused_keys(keys))
        self._recent(keys)
        self._forget_if_done(state, keys, req_context)

    def _forget_if_done(
        self, state: _RequestKeys, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> None:
        """Drop a finished request's keys once none of its stores is in flight: nothing will
        refresh them again, and an engine (or a benchmark) may keep the context long after."""
        if not self._pending or self._pending.keys().isdisjoint(keys):
            req_context.set_state(_DONE)

    def _recent(self, keys: Collection[OffloadKey]) -> None:
        """``keys`` (prefix order) were made recent in the policy: a hook for a subclass that
        keeps blocks in recency orders of its own (the stack's unsaved blocks)."""

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self._events is None:
            return iter(())
        # Swap before yielding, so a consumer that stops early cannot see an event twice.
        events, self._events = self._events, []
        if any(event.metadata_only for event in events):
            events = self._drop_retried(events)
        return iter(events)

    def _drop_retried(self, events: list[OffloadingEvent]) -> list[OffloadingEvent]:
        """``events`` less the keys of failed-store events that a later store has taken again
        (pending or ready now): retracting those would drop the new store's state."""
        contains, pending = self._contains, self._pending
        kept = []
        for event in events:
            if event.metadata_only:
                keys = [key for key in event.keys if key not in pending and not contains(key)]
                if not keys:
                    continue
                event = dataclasses.replace(event, keys=keys)
            kept.append(event)
        return kept

    def reset_cache(self) -> None:
        dropped = self._policy.clear()
        if dropped and self._causes is not None:
            self._causes.remember([key for key, _ in dropped], EVICTED, 0)
        backend = self._backend
        backend.free_block_ids([block_id for _, block_id in dropped])
        backend.free_block_ids(self._pending.values())
        self._pending.clear()
        self._holds.clear()
        if dropped and self._events is not None:
            self._events.append(
                OffloadingEvent([key for key, _ in dropped], backend.block_size, backend.medium, True)
            )

    def add_shutdown_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once at :meth:`shutdown`, while :meth:`stats` still answers (a stack's
        with its final figures): how a metrics reporter writes its last snapshot and stops."""
        self._shutdown_hooks.append(hook)

    def shutdown(self) -> None:
        hooks, self._shutdown_hooks = self._shutdown_hooks, []
        for hook in hooks:
            hook()
        self.reset_cache()
        self._backend.shutdown()

    # -- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Block counts by state, free slots, evictions since start, and what the eviction
        policy has learnt (``policy_<name>``, e.g. ``chain``'s ``policy_protected_share``)."""
        figures: dict[str, float] = {
            "ready_blocks": len(self._policy),
            "pending_blocks": len(self._pending),
            "held_blocks": len(self._policy) - self._policy.evictable_blocks(),
            "free_blocks": self._backend.get_num_free_blocks(),
            "evictions": self.evictions,
        }
        for name, value in self._policy.describe().items():
            figures["policy_" + name] = value
        if self._causes is not None:
            causes = self._causes.stats()
            figures["misses"] = sum(causes[f"miss_{cause}"] for cause in CAUSES)
            figures.update(causes)
        return figures

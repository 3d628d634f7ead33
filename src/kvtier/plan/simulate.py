"""Bookkeeping-only replay of a trace through one pooled cache ordered by a real policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass

from kvtier.policies.base import EvictionPolicy

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """Prefix hits out of block references, and the simulation's own seconds."""

    hits: int
    refs: int
    seconds: float = 0.0
    #: with ``causes``: the missed references (``refs - hits``) by cause: ``new`` (never
    #: stored before), ``evicted`` (stored, then evicted), ``behind`` (present, but after
    #: the request's first miss, so computed again under prefix matching)
    misses: dict[str, int] | None = None

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.refs if self.refs else 0.0


def simulate(
    chains: Sequence[Sequence[int]],
    policy: EvictionPolicy,
    capacity: int,
    on_request: Callable[[int], None] | None = None,
    causes: bool = False,
) -> SimResult:
    """Replay ``chains`` (each request's block ids, prefix order) through ``capacity`` slots.

    The same calls, in the same order, as the managers make for one request in one step
    under vLLM 0.33's connector: the request looks its blocks up in prefix order and hits
    the leading run found (``contains``), stores every block it has that the cache lacks
    (``evict_unheld`` for room, passing over its own present blocks as the manager does, then
    ``insert`` in prefix order) and finishes (``request_finished`` with its whole chain; the
    run it loaded and the present blocks it offered again are its reused keys). No
    ``touch``: vLLM's connector never calls it. Nothing is held, no bytes move: only the
    policy decides.
    Keys are the trace's integer block ids — a policy only hashes and compares keys.

    A request longer than the cache stores only its first ``capacity`` blocks.
    ``on_request``, if given, is called with each request's index before its lookups: the
    planner's oracle (:mod:`kvtier.plan.oracle`) learns the time from it; policies never do.
    ``causes``: also count each missed reference as new, evicted or behind a miss
    (:attr:`SimResult.misses`; exact: the simulation knows every block it ever stored).
    """
    import time

    start = time.process_time()
    keyed: Any = policy  # keyed by the trace's int block ids (a policy only hashes, compares)
    contains, insert, finished = keyed.contains, keyed.insert, keyed.request_finished
    evict = keyed.evict_unheld
    free = list(range(capacity))
    hits = refs = 0
    stored: set[int] | None = set() if causes else None  # every block ever inserted
    new = evicted = behind = 0
    for index, chain in enumerate(chains):
        if on_request is not None:
            on_request(index)
        refs += len(chain)
        found = 0
        for block in chain:
            if not contains(block):
                break
            found += 1
        hits += found
        missing = []
        present = list(chain[:found])  # the manager's `protected`: the offer's ready keys
        for block in chain[found:]:
            if contains(block):
                present.append(block)
            else:
                missing.append(block)
        if stored is not None:
            behind += len(present) - found
            gone = sum(1 for block in missing if block in stored)
            evicted += gone
            new += len(missing) - gone
        if not missing:
            finished(chain, set(present))
            continue
        if len(missing) > 1:
            missing = list(dict.fromkeys(missing))  # a block repeated in a chain gets one slot
        del missing[capacity:]
        shortfall = len(missing) - len(free)
        if shortfall > 0:
            victims = evict(shortfall, set(present)) if present else evict(shortfall)
            if victims is None:
                victims = evict(shortfall)  # a request longer than the cache: its own go too
            if victims is None:  # cannot happen with nothing held; keep the cache consistent
                raise RuntimeError(f"{type(policy).__name__} refused to evict {shortfall} blocks")
            free.extend(block_id for _, block_id in victims)
        slots = free[-len(missing) :]
        del free[-len(missing) :]
        insert(missing, slots)
        if stored is not None:
            stored.update(missing)
        finished(chain, set(present))
    misses = {"new": new, "evicted": evicted, "behind": behind} if stored is not None else None
    return SimResult(hits, refs, time.process_time() - start, misses)

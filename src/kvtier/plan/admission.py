"""Disk admission in the planner: what ``admit: reuse`` refuses and loses, against an oracle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass

from kvtier.plan.oracle import last_reference
from kvtier.plan.simulate import SimResult
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.base import EvictionPolicy

__all__ = ["AdmissionResult", "simulate_admission"]


@dataclass(frozen=True)
class AdmissionResult(SimResult):
    """One run of a CPU tier over an unbounded disk tier, counted in blocks (``hits`` and
    ``refs`` as :class:`SimResult`'s, from either tier)."""

    #: blocks written to the disk tier
    writes: int = 0
    #: blocks read back from it (promotions)
    reads: int = 0
    #: blocks the admission filter refused
    refused: int = 0
    #: of ``writes``, blocks no request names after they left the CPU tier: an oracle
    #: admission refuses exactly these, and loses no hit (their disk copy is never read)
    needless_writes: int = 0


def simulate_admission(
    chains: Sequence[Sequence[int]],
    policy: EvictionPolicy,
    capacity: int,
    admission: AdmissionFilter | None = None,
) -> AdmissionResult:
    """Replay ``chains`` through a CPU tier of ``capacity`` blocks (ordered by ``policy``) over
    a disk tier larger than the trace, writing a block below when it leaves the CPU tier.

    The stack's model, as bookkeeping: a request hits the leading run of its blocks found in
    either tier; those found only on disk are read up (promoted) into the CPU tier, and every
    block after the run is computed and stored in the CPU tier (already on disk or not: the
    run is broken); then the request finishes (``request_finished``: its chain, with the
    blocks it loaded and the present ones it offered again as reused), as under vLLM 0.33's connector. A block leaving the CPU tier is
    written to disk unless it is there already or ``admission`` refuses it (``None``: every
    block is taken, ``admit: all``). As in the manager, the filter counts a key when it is
    stored (offered) and when it is hit (so every block a request names counts once), and
    decides when the block would be written: here when the CPU tier evicts it, which is
    ``write_back`` with the write coming last (the manager writes the coldest dirty blocks a
    little ahead of their eviction). Blocks still in the CPU tier when the trace ends are not
    written (a CPU tier larger than the trace writes nothing).

    With a disk that never evicts, ``admit: all`` serves the unbounded ceiling; what a filter
    refuses and is wanted again shows up as lost hits. Cost: the policy's per block, plus O(1)
    per block reference.
    """
    last = last_reference(chains)
    keyed: Any = policy  # keyed by the trace's int block ids (a policy only hashes, compares)
    contains, insert, evict = keyed.contains, keyed.insert, keyed.evict_unheld
    finished = keyed.request_finished
    record = admission.record if admission is not None else None
    admit = admission.admit if admission is not None else None
    disk: set[int] = set()
    free = list(range(capacity))
    hits = refs = writes = reads = refused = needless = 0
    for index, chain in enumerate(chains):
        refs += len(chain)
        found = 0
        in_cpu: list[int] = []
        promote: list[int] = []
        for block in chain:
            if contains(block):
                in_cpu.append(block)
            elif block in disk:
                promote.append(block)
            else:
                break
            found += 1
        hits += found
        reads += len(promote)
        reused = set(in_cpu).union(promote)  # loaded, from the CPU tier or read up to it
        reused.update(b for b in chain[found:] if contains(b))  # offered again while present
        store = promote + [b for b in dict.fromkeys(chain[found:]) if not contains(b)]
        if record is not None:  # every block of a request is either hit or offered
            for block in chain:
                record(block)
        del store[capacity:]
        if not store:
            finished(chain, reused)
            continue
        shortfall = len(store) - len(free)
        if shortfall > 0:
            present = {b for b in chain if contains(b)}
            victims = evict(shortfall, present) if present else evict(shortfall)
            if victims is None:
                victims = evict(shortfall)
            if victims is None:
                raise RuntimeError(f"{type(policy).__name__} refused to evict {shortfall} blocks")
            for block, slot in victims:
                free.append(slot)
                if block in disk:
                    continue
                if admit is not None and not admit(block):
                    refused += 1
                    continue
                disk.add(block)
                writes += 1
                needless += last[block] <= index
        slots = free[-len(store) :]
        del free[-len(store) :]
        insert(store, slots)
        finished(chain, reused)
    return AdmissionResult(hits, refs, writes=writes, reads=reads, refused=refused, needless_writes=needless)

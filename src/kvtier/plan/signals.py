"""What a policy could know when it stores a block, and how well it predicts reuse, on one trace."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from statistics import median
from typing import Any

__all__ = ["AGE_EDGES", "LENGTH_EDGES", "SIGNALS", "reuse_signals"]

#: the signals reported, in order, with what each one selects (block references)
SIGNALS = {
    "new": "first reference to the block",
    "seen_before": "the block was referenced before",
    "new_last_block": "new, and the last block of its request",
    "new_body_block": "new, and not the last block of its request",
    "new_after_prefix_hit": "new, in a request whose first block was seen before",
    "new_without_prefix_hit": "new, in a request whose first block is new too",
}

#: age buckets (block references since a block was stored) of the first-reuse hazard
AGE_EDGES = (0, 1000, 2000, 4000, 8000, 16000, 32000, 64000)
#: request-length buckets (blocks in the request) of the length signal; the last is open
LENGTH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128)


def reuse_signals(chains: Sequence[Sequence[int]], age_edges: Sequence[int] = AGE_EDGES) -> dict[str, Any]:
    """For each of :data:`SIGNALS`: how many block references it selects and the share of them
    referenced again later (``p_again``); plus how far apart references to a block come, in
    requests and in block references (medians): between any two in a row
    (``reuse_distance_median``), and between a block's first and second reference
    (``first_reuse_distance_median``, the wait a new block must survive to earn its first hit).
    ``first_reuse_by_age`` is the age signal: for each bucket of ``age_edges``, the chance
    per 1,000 block references that a block not referenced again yet is referenced in that
    bucket (blocks whose bucket ends past the trace's end are left out: their future is not
    seen). Flat means an unproven block's age tells nothing — no recency order helps;
    falling means young blocks are the likelier ones, which is what LRU bets on.
    ``new_by_request_blocks`` is the length signal: new blocks by how many blocks their
    request has (buckets from ``LENGTH_EDGES``, the last one open), each with ``p_again``.

    All of these are known online when a request's blocks are stored, except whether the block
    is referenced again — the outcome each signal is meant to predict. A signal whose
    ``p_again`` is far from the overall one is worth a policy's attention; ones close to it
    are not. One pass backwards for the outcome, one forwards: O(block references).
    """
    again: list[list[bool]] = [[] for _ in chains]
    later: set[int] = set()
    for index in range(len(chains) - 1, -1, -1):
        chain = chains[index]
        again[index] = [block in later for block in chain]
        later.update(chain)
    counts = {name: [0, 0] for name in SIGNALS}  # name -> [references, referenced again]
    last_seen: dict[int, tuple[int, int]] = {}  # block -> (request index, block refs before it)
    first_seen: set[int] = set()  # blocks referenced exactly once so far
    stored_at: dict[int, int] = {}  # block -> block refs before its first reference
    first_gap: dict[int, int] = {}  # block -> block refs from its first to its second reference
    distances: dict[str, tuple[list[int], list[int]]] = {  # (in requests, in block refs)
        "reuse_distance_median": ([], []),
        "first_reuse_distance_median": ([], []),
    }
    by_length = [[0, 0] for _ in LENGTH_EDGES]  # length bucket -> [new blocks, referenced again]
    refs = 0
    for index, chain in enumerate(chains):
        prefix_hit = bool(chain) and chain[0] in last_seen
        end = len(chain) - 1
        length_bucket = by_length[bisect_right(LENGTH_EDGES, len(chain)) - 1] if chain else None
        for position, block in enumerate(chain):
            seen = last_seen.get(block)
            if seen is None:
                names = [
                    "new",
                    "new_last_block" if position == end else "new_body_block",
                    "new_after_prefix_hit" if prefix_hit else "new_without_prefix_hit",
                ]
            else:
                names = ["seen_before"]
                for kind in ("reuse_distance_median", "first_reuse_distance_median"):
                    if kind == "reuse_distance_median" or block in first_seen:
                        distances[kind][0].append(index - seen[0])
                        distances[kind][1].append(refs - seen[1])
                if block in first_seen:
                    first_gap[block] = refs - seen[1]
                first_seen.discard(block)
            if seen is None:
                first_seen.add(block)
                stored_at[block] = refs
                length_bucket[0] += 1  # type: ignore[index]
                length_bucket[1] += again[index][position]  # type: ignore[index]
            for name in names:
                counts[name][0] += 1
                counts[name][1] += again[index][position]
            last_seen[block] = (index, refs)
            refs += 1
    signals: dict[str, Any] = {
        name: {"refs": n, "p_again": round(hit / n, 3) if n else None} for name, (n, hit) in counts.items()
    }
    total = sum(counts[name][0] for name in ("new", "seen_before"))
    reused = sum(counts[name][1] for name in ("new", "seen_before"))
    signals["all"] = {"refs": total, "p_again": round(reused / total, 3) if total else None}
    for kind, (in_requests, in_refs) in distances.items():
        signals[kind] = {
            "requests": median(in_requests) if in_requests else None,
            "block_refs": median(in_refs) if in_refs else None,
        }
    signals["first_reuse_by_age"] = _hazard(stored_at, first_gap, refs, age_edges)
    highs = [*(edge - 1 for edge in LENGTH_EDGES[1:]), None]
    signals["new_by_request_blocks"] = [
        {"request_blocks": [low, high], "refs": n, "p_again": round(hit / n, 3) if n else None}
        for low, high, (n, hit) in zip(LENGTH_EDGES, highs, by_length)
    ]
    return signals


def _hazard(
    stored_at: dict[int, int], first_gap: dict[int, int], refs: int, edges: Sequence[int]
) -> list[dict[str, Any]]:
    """Per age bucket: of the blocks unreferenced at its start whose bucket ends inside the
    trace, the share first referenced again within it, per 1,000 block references."""
    rows = []
    for low, high in zip(edges, edges[1:]):
        at_risk = reused = 0
        for block, start in stored_at.items():
            if start + high > refs:
                continue
            gap = first_gap.get(block)
            if gap is not None and gap < low:
                continue
            at_risk += 1
            reused += gap is not None and gap < high
        rows.append(
            {
                "age_refs": [low, high],
                "blocks": at_risk,
                "p_per_1k_refs": round(1000 * reused / at_risk / (high - low), 4) if at_risk else None,
            }
        )
    return rows

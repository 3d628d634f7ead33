"""Which engine holds which blocks, on which medium: the index a prefix-aware router scores from.

Fed by the engines' KV events (:mod:`kvtier.routing.events`), it keeps per block hash the
engines holding it and on which media, each with a count of the stores announced and not yet
removed (vLLM announces a block again for each offloaded chunk that overlaps it, and expects
consumers to count). A block on a **shared** medium (kvtier's Valkey tier: every engine reads
the same server) counts as held by every engine.

Costs: an event updates its blocks only, O(blocks in it); :meth:`PrefixIndex.score` walks a
request's blocks once and, per block, the engines still matching, O(its blocks x engines),
and stops at the first block no engine holds. Bounded: at most ``max_blocks`` hashes, the one
longest unused forgotten first (an engine that died without a word cannot grow it); a block
that scoring matched counts as used, so a hot system prompt stays. Clearing an engine's GPU
cache (``AllBlocksCleared``) or forgetting an engine walks the whole index: rare events.

One thread: the router's. Nothing here blocks or does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvtier.routing.events import ALL_CLEARED, GPU_MEDIUM, BlockEvent

__all__ = ["DEFAULT_MEDIUM_WEIGHTS", "DEFAULT_SHARED_MEDIA", "PrefixIndex"]

#: What a block held on each medium is worth to a request, as a share of what recomputing it
#: costs (a GPU block: all of it). A load from the CPU tier is a PCIe copy, a small part of the
#: block's prefill; from a disk or a remote store the read comes first and may queue. Rough on
#: purpose (the ratio between GPU and the rest is what moves a choice); a deployment that
#: measured its tiers passes its own (``kvtier bench`` and ``kvtier plan`` give the speeds).
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {
    "GPU": 1.0,
    "CPU": 0.8,
    "MEMORY": 0.8,
    "LMDB": 0.5,
    "FILES": 0.5,
    "STORAGE": 0.5,  # vLLM's name for every medium below its CPU tier
    "VALKEY": 0.4,
}
#: the weight of a medium missing from the weights given
UNKNOWN_MEDIUM_WEIGHT = 0.5
#: media every engine reads, so a block on one is every engine's
DEFAULT_SHARED_MEDIA = ("VALKEY",)
#: the most block hashes an index keeps unless told otherwise (memory per hash:
#: docs/routing.md#the-cost-of-the-index)
DEFAULT_MAX_BLOCKS = 1_000_000


class PrefixIndex:
    """Block hash -> the engines (and media) holding it; see the module docstring.

    ``engines``: the fleet's size (engines are ``0 .. engines-1``); ``weights``: medium name
    -> weight (:data:`DEFAULT_MEDIUM_WEIGHTS`); ``shared``: media every engine reads.
    """

    def __init__(
        self,
        engines: int,
        *,
        weights: Mapping[str, float] | None = None,
        shared: Iterable[str] = DEFAULT_SHARED_MEDIA,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ):
        if engines < 1:
            raise ValueError(f"a fleet has at least one engine, got engines={engines}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.engines = engines
        self.max_blocks = max_blocks
        self._weights = dict(DEFAULT_MEDIUM_WEIGHTS if weights is None else weights)
        for medium, weight in self._weights.items():
            if not 0 <= weight <= 1:
                raise ValueError(f"the weight of medium {medium!r} is {weight}; expected 0 <= weight <= 1")
        self._shared = frozenset(shared)
        # A holder is an engine, or ``engines`` for the shared media. A slot packs a holder and
        # a medium's number into one int (holder + (engines + 1) x medium): one small dict of
        # ints per block, where (holder, medium) tuples cost an allocation each.
        self._stride = engines + 1
        self._medium_ids: dict[str, int] = {}
        self._slot_weights: list[float] = []  # by medium number
        #: block hash -> {slot: stores announced and not removed}, least recently used first
        self._blocks: OrderedDict[Hashable, dict[int, int]] = OrderedDict()
        #: hashes dropped to keep within max_blocks
        self.forgotten_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _medium(self, name: str) -> int:
        number = self._medium_ids.get(name)
        if number is None:
            number = self._medium_ids[name] = len(self._slot_weights)
            self._slot_weights.append(self._weights.get(name, UNKNOWN_MEDIUM_WEIGHT))
        return number

    def weight(self, medium: str) -> float:
        """What a block on ``medium`` is worth (see :data:`DEFAULT_MEDIUM_WEIGHTS`)."""
        return self._weights.get(medium, UNKNOWN_MEDIUM_WEIGHT)

    def apply(self, engine: int, events: Iterable[BlockEvent]) -> None:
        """Take ``engine``'s events, in the order it reported them."""
        if not 0 <= engine < self.engines:
            raise ValueError(f"engine {engine} is not one of 0..{self.engines - 1}")
        blocks = self._blocks
        for event in events:
            if event.kind == ALL_CLEARED:
                self._drop(engine, GPU_MEDIUM)
                continue
            holder = self.engines if event.medium in self._shared else engine
            slot = holder + self._stride * self._medium(event.medium)
            if event.kind == "stored":
                for block_hash in event.block_hashes:
                    holders = blocks.get(block_hash)
                    if holders is None:
                        holders = blocks[block_hash] = {}
                        if len(blocks) > self.max_blocks:
                            blocks.popitem(last=False)
                            self.forgotten_blocks += 1
                    else:
                        blocks.move_to_end(block_hash)
                    holders[slot] = holders.get(slot, 0) + 1
            elif event.kind == "removed":
                for block_hash in event.block_hashes:
                    holders = blocks.get(block_hash)
                    if holders is None or slot not in holders:
                        continue  # never announced, or forgotten: nothing to undo
                    if holders[slot] > 1:
                        holders[slot] -= 1
                    else:
                        del holders[slot]
                        if not holders:
                            del blocks[block_hash]
            else:
                raise ValueError(
                    f"a block event's kind is {event.kind!r}; expected stored, removed or cleared"
                )

    def forget_engine(self, engine: int) -> None:
        """Drop everything ``engine`` reported (it left the fleet, or restarted empty)."""
        self._drop(engine, None)

    def _drop(self, engine: int, medium: str | None) -> None:
        stride = self._stride
        number = None if medium is None else self._medium_ids.get(medium)
        if medium is not None and number is None:
            return
        for block_hash in list(self._blocks):
            holders = self._blocks[block_hash]
            for slot in [
                s for s in holders if s % stride == engine and (number is None or s // stride == number)
            ]:
                del holders[slot]
            if not holders:
                del self._blocks[block_hash]

    def score(self, block_hashes: Sequence[Hashable]) -> list[float]:
        """Per engine, the weighted length of the request's prefix it holds: over the leading
        blocks it holds on some medium (a shared one counts for every engine), each block's
        best medium's weight. Blocks matched count as used (see the module docstring)."""
        engines, stride = self.engines, self._stride
        weights = self._slot_weights
        blocks = self._blocks
        totals = [0.0] * engines
        alive = list(range(engines))
        for block_hash in block_hashes:
            holders = blocks.get(block_hash)
            if holders is None:
                break
            blocks.move_to_end(block_hash)
            best: dict[int, float] = {}
            for slot in holders:
                holder = slot % stride
                weight = weights[slot // stride]
                if weight > best.get(holder, 0.0):
                    best[holder] = weight
            shared = best.pop(engines, 0.0)
            if shared:  # every engine still matching goes on, at its best or the shared weight
                for engine in alive:
                    weight = best.get(engine, 0.0)
                    totals[engine] += weight if weight > shared else shared
                continue
            alive = [engine for engine in alive if engine in best]
            if not alive:
                break
            for engine in alive:
                totals[engine] += best[engine]
        return totals

    def holders(self, block_hash: Hashable) -> dict[int, set[str]]:
        """Who holds ``block_hash``: engine (``engines`` for the shared media) -> media."""
        names = {number: name for name, number in self._medium_ids.items()}
        found: dict[int, set[str]] = {}
        for slot in self._blocks.get(block_hash, {}):
            found.setdefault(slot % self._stride, set()).add(names[slot // self._stride])
        return found

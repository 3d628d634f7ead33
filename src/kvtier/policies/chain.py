"""Prefix-chain-aware segmented LRU: proven prefixes stay, unproven chains leave tail first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import TwoQueuePolicy

__all__ = ["ChainPolicy"]

#: share of the capacity that blocks with a hit may fill before the oldest of them go back
#: to probation (the classic segmented-LRU split)
PROTECTED_SHARE = 0.8
#: ghost keys remembered per block of capacity: keys cost ~100 bytes against a block's
#: megabytes, and reuse distances in KV traces run to several cache sizes
GHOST_FACTOR = 4


class ChainPolicy(TwoQueuePolicy):
    """What a KV cache knows and a generic cache does not, turned into an eviction order.

    Three facts about prefix caches drive it:

    * **A block is only useful while its whole prefix is cached.** A request hits the leading
      run of its blocks, so block *i* serves no hit once block *i - 1* is gone. The manager
      hands a request's keys over in prefix order (``insert`` from one store, ``touch`` from
      one lookup), so the policy lays each batch into its queue *reversed*: the chain's tail
      is the oldest and leaves first, its head last. LRU does the opposite — it inserts the
      head first, so the head is evicted first, and the rest of the chain stays in the cache
      without serving a single hit.
    * **A block's value is the hits it enables, and hits prove reuse.** A block hit once is
      far likelier to be hit again than one never hit (most stored blocks never are: the
      Mooncake paper measured over half). Blocks never hit wait in ``_probation``; the first
      hit moves a block to ``_protected``, and eviction takes from probation first. Hits on a
      chain come as a leading run, so a prefix's blocks have at least the hits of any block
      after them; tail-first order keeps that.
    * **A block stored again soon after it was evicted was wanted.** Keys evicted from
      probation are remembered (``_ghost``, keys only, at most ``GHOST_FACTOR`` times
      ``capacity_blocks``: first reuses in KV traces often come several cache sizes later);
      such a key is stored straight into ``_protected``.

    ``_protected`` may hold up to 80% of the ready blocks; past that its least recently used
    block goes back to the recent end of probation (one more chance to prove itself) rather
    than out. So a burst of one-off chains can only ever flush probation, and a shift in the
    working set still reaches the protected blocks, through probation, in LRU order.

    Held keys leave both queues (eviction never walks past one); ``_held_protected`` names
    those that belong to ``_protected``. A released key returns to the recent end of its
    queue; a held key that is touched moves to ``_protected``. Only ``touch`` is a use: a
    hold may be a save to a lower tier, which says nothing about reuse.

    Cost: every method is O(keys named + victims); a protected block moved back to probation
    is one ``OrderedDict`` move, at most one per block that enters protected.
    """

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, None] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._held_protected: set[OffloadKey] = set()
        # the names TwoQueuePolicy's holds work on
        self._first, self._second, self._held_second = self._probation, self._protected, self._held_protected
        self._protected_limit = max(1, int(PROTECTED_SHARE * capacity_blocks))
        self._parts = (self._probation, self._protected, self._ghost, self._held_protected)

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._index.update(zip(keys, block_ids))
        probation, protected, ghost = self._probation, self._protected, self._ghost
        for key in reversed(keys):  # the chain's tail oldest: it leaves first
            if ghost and key in ghost:
                del ghost[key]
                protected[key] = None
            else:
                probation[key] = None
        self._shrink_protected()

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._index.pop(key, None)
        if block_id is not None:
            if self._probation.pop(key, 0) is not None and self._protected.pop(key, 0) is not None:
                self._held_protected.discard(key)
        return block_id

    def touch(self, keys: Collection[OffloadKey]) -> None:
        probation, protected, index = self._probation, self._protected, self._index
        ordered = keys if isinstance(keys, Sequence) else list(keys)
        for key in reversed(ordered):  # the prefix's head ends most recent
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
            elif key in index:  # held: it returns to protected on release
                self._held_protected.add(key)
        self._shrink_protected()

    def _shrink_protected(self) -> None:
        protected, probation = self._protected, self._probation
        excess = len(protected) + len(self._held_protected) - self._protected_limit
        while excess > 0 and protected:
            key, _ = protected.popitem(last=False)
            probation[key] = None
            excess -= 1

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        probation, protected = self._probation, self._protected
        if count > len(probation) + len(protected):
            return None
        if not skip:
            # Nothing to pass over: probation's oldest, then protected's, are the victims.
            self.entries_visited += count
            pop = self._index.pop
            from_probation = min(count, len(probation))
            chosen = [probation.popitem(last=False)[0] for _ in range(from_probation)]
            chosen += [protected.popitem(last=False)[0] for _ in range(count - from_probation)]
            self._remember(chosen[:from_probation])
            return [(key, pop(key)) for key in chosen]
        chosen: list[OffloadKey] = []
        from_probation = 0
        walked = 0
        # Choose first (iterators only read), so a failure changes nothing.
        for queue in (probation, protected):
            for key in queue:
                if len(chosen) == count:
                    break
                walked += 1
                if key not in skip:
                    chosen.append(key)
                    from_probation += queue is probation
        self.entries_visited += walked
        if len(chosen) < count:
            return None
        pop = self._index.pop
        for key in chosen[:from_probation]:
            del probation[key]
        for key in chosen[from_probation:]:
            del protected[key]
        self._remember(chosen[:from_probation])
        return [(key, pop(key)) for key in chosen]

    def _remember(self, keys: list[OffloadKey]) -> None:
        """Keep ``keys`` (just evicted from probation) as ghosts, forgetting the oldest."""
        ghost = self._ghost
        ghost.update(dict.fromkeys(keys))
        while len(ghost) > GHOST_FACTOR * self.capacity_blocks:
            ghost.popitem(last=False)


"""Prefix-chain-aware segmented LRU: proven prefixes stay, unproven chains leave tail first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import TwoQueuePolicy, append_all, drop_oldest, tail_first
from kvtier.policies.tuner import SettingTuner

__all__ = ["ChainPolicy"]

#: the protected shares the adaptive policy races (:class:`ChainPolicy`): 0 is LRU order with
#: chains leaving tail first, 0.9 a strong segmented LRU (docs/design/policies.md#chain)
SHARES = (0.0, 0.5, 0.9)
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
      far likelier to be hit again than one never hit, and most stored blocks never are.
      Blocks never hit wait in ``_probation``; the first hit moves a block to
      ``_protected``, and eviction takes from probation first. Hits on a
      chain come as a leading run, so a prefix's blocks have at least the hits of any block
      after them; tail-first order keeps that.
    * **A block stored again soon after it was evicted was wanted.** Keys evicted from
      probation are remembered (``_ghost``, keys only, at most ``GHOST_FACTOR`` times
      ``capacity_blocks``: first reuses often come several cache sizes later);
      such a key is stored straight into ``_protected``.

    ``_protected`` may hold up to a share of the ready blocks; past that its least recently
    used block goes back to the recent end of probation (one more chance to prove itself)
    rather than out. So a burst of one-off chains can only ever flush probation, and a shift
    in the working set still reaches the protected blocks, through probation, in LRU order.

    **The share is learnt, not fixed** (``protected_share=None``, the default). How much
    room proven blocks deserve depends on the workload: where documents are read again long
    after their first use (the bundled trace), a large protected share keeps them through
    floods of one-off prompts; where conversations come back for their next turn soon after
    the last (Mooncake's conversation trace), every new block is as likely to be reused as a
    proven one, and a large protected share keeps finished conversations while it drops the
    live ones (docs/design/policies.md#chain). A
    :class:`~kvtier.policies.tuner.SettingTuner` races one small copy of this policy per
    share in ``SHARES`` on a hash sample of the keys, and puts in force the share of the copy
    with the most recent hits; it starts at 0 (LRU order), so it protects proven blocks only
    once doing so is seen to pay, and a workload where LRU order is best never pays for the
    race's lessons in a segment full of the dead. A lowered share drains protected gradually (at most two blocks
    per key named plus eight per call), so a change costs O(1) amortized too.
    ``protected_share=s`` fixes the share at ``s`` (the copies are built that way).

    Held keys leave both queues (eviction never walks past one); ``_held_protected`` names
    those that belong to ``_protected``. A released key returns to the recent end of its
    queue; a held key that is touched moves to ``_protected``. Only ``touch`` is a use: a
    hold may be a save to a lower tier, which says nothing about reuse.

    Cost: every method is O(keys named + victims); a protected block moved back to probation
    is one ``OrderedDict`` move, at most one per block that enters protected. The learnt
    share adds a hash per key named, and the copies' own work on the sampled keys: about
    ``len(SHARES) / 2**shift`` of this policy's, with 1/32 the rate from 2,048 blocks up.
    """

    def __init__(self, capacity_blocks: int, protected_share: float | None = None):
        super().__init__(capacity_blocks)
        self._probation: OrderedDict[OffloadKey, None] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, None] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._held_protected: set[OffloadKey] = set()
        # the names TwoQueuePolicy's holds work on
        self._first, self._second, self._held_second = self._probation, self._protected, self._held_protected
        self._parts = (self._probation, self._protected, self._ghost, self._held_protected)
        self._tuner: SettingTuner | None = None
        if protected_share is None:
            start = SHARES[0]  # LRU order until protecting proven blocks is seen to pay
            self._set_share(start)
            self._tuner = SettingTuner(capacity_blocks, SHARES, start, _fixed_share, self._set_share)
        else:
            self._set_share(protected_share)

    @property
    def protected_share(self) -> float:
        """The share of the capacity proven blocks may fill now."""
        return self._share

    @property
    def share_changes(self) -> int:
        """How many times the learnt share changed (0 for a fixed one)."""
        return self._tuner.changes if self._tuner is not None else 0

    @property
    def shadow_entries_visited(self) -> int:
        """Entries the racing copies' evictions examined (0 for a fixed share); the flat-cost
        test adds them to ``entries_visited``, so the race is held to the same bound."""
        return self._tuner.entries_visited if self._tuner is not None else 0

    def describe(self) -> dict[str, float]:
        return {"protected_share": self._share, "share_changes": self.share_changes}

    def _set_share(self, share: float) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"protected_share must be in [0, 1), got {share}")
        self._share = share
        self._protected_limit = int(share * self.capacity_blocks)

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._index.update(zip(keys, block_ids))
        probation, protected, ghost = self._probation, self._protected, self._ghost
        for key in reversed(keys):  # the chain's tail oldest: it leaves first
            if ghost and key in ghost:
                del ghost[key]
                protected[key] = None
            else:
                probation[key] = None
        self._shrink_protected(len(keys))
        if self._tuner is not None:
            self._tuner.observe(keys)

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
        self._shrink_protected(len(ordered))
        if self._tuner is not None:
            self._tuner.observe(ordered)

    def refresh(self, keys: Collection[OffloadKey]) -> None:
        # Recency within its own queue: only a hit proves reuse, so probation stays probation.
        probation, protected = self._probation, self._protected
        for key in tail_first(keys):
            if key in probation:
                probation.move_to_end(key)
            elif key in protected:
                protected.move_to_end(key)

    def _shrink_protected(self, named: int) -> None:
        """Send protected's oldest to probation while it is over its share: at most what
        this call of ``named`` keys added plus what a lowered share left over, bounded."""
        protected, probation = self._protected, self._probation
        excess = len(protected) + len(self._held_protected) - self._protected_limit
        excess = min(excess, 2 * named + 8)
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
        chosen = []
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
        append_all(ghost, keys)
        drop_oldest(ghost, len(ghost) - GHOST_FACTOR * self.capacity_blocks)


def _fixed_share(share: float, capacity_blocks: int) -> ChainPolicy:
    """A chain policy whose share is ``share``: one of the tuner's racing copies."""
    return ChainPolicy(capacity_blocks, protected_share=share)

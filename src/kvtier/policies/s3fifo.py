"""S3-FIFO eviction (Yang et al., SOSP'23): a small probation queue, a main queue, a ghost queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import TwoQueuePolicy, append_all, drop_oldest

__all__ = ["S3FIFOPolicy"]

#: share of the capacity the small queue aims at (the paper's 10%)
SMALL_SHARE = 0.1
#: uses remembered per block (two bits, as in the paper)
MAX_FREQ = 3


class S3FIFOPolicy(TwoQueuePolicy):
    """Most blocks are used once: make them leave soon, through a small FIFO queue.

    A new block enters the small queue ``_small`` — unless its key is in the ghost queue
    ``_ghost`` (it was dropped from the small queue recently and came back), then it enters
    the main queue ``_main``. A hit only counts a use (``_freq``, capped at 3). Eviction
    takes from the small queue while it holds at least 10% of the ready blocks: its oldest
    block moves to the main queue if it was used since it arrived, else it is dropped and its
    key remembered as a ghost. From the main queue, a block with uses left is reinserted at
    the newest end with one use fewer; one without is dropped. Ghosts are keys only, at most
    ``capacity_blocks`` of them, oldest forgotten first.

    Held keys leave both queues; ``_held_main`` names those whose queue is the main one. A
    released key returns to the newest end of its queue; its uses are what ``touch`` counted
    (a hold may be a save to a lower tier, which is no use of the block).

    Cost: a block is moved or has its count lowered at most ``MAX_FREQ + 1`` times per use,
    so eviction is O(1) amortized per victim.
    """

    # a use only counts (the queue is decided at eviction time)
    _use_moves_to_second = False

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._small: OrderedDict[OffloadKey, None] = OrderedDict()
        self._main: OrderedDict[OffloadKey, None] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._freq: dict[OffloadKey, int] = {}
        self._held_main: set[OffloadKey] = set()
        # the names TwoQueuePolicy's holds work on
        self._first, self._second, self._held_second = self._small, self._main, self._held_main
        self._parts = (self._small, self._main, self._ghost, self._freq, self._held_main)

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._index.update(zip(keys, block_ids))
        ghost, small, main, freq = self._ghost, self._small, self._main, self._freq
        for key in reversed(keys):  # the head enters last, so it leaves its queue last
            freq[key] = 0
            if ghost and key in ghost:
                del ghost[key]
                main[key] = None
            else:
                small[key] = None

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._index.pop(key, None)
        if block_id is not None:
            del self._freq[key]
            if self._small.pop(key, 0) is not None and self._main.pop(key, 0) is not None:
                self._held_main.discard(key)
        return block_id

    def touch(self, keys: Collection[OffloadKey]) -> None:
        freq = self._freq
        for key in keys:
            count = freq.get(key)
            if count is not None and count < MAX_FREQ:
                freq[key] = count + 1

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        small, main, freq, index = self._small, self._main, self._freq, self._index
        if isinstance(skip, Collection):
            skipped = sum(1 for key in skip if key in small or key in main)
        else:
            skipped = sum(1 for key in (*small, *main) if key in skip)
        if count > len(small) + len(main) - skipped:
            return None
        # Skipped keys are set aside and put back at the oldest end of their queue afterwards,
        # so they keep their place and the walk never meets them twice.
        aside_small: list[OffloadKey] = []
        aside_main: list[OffloadKey] = []
        victims: list[tuple[OffloadKey, int]] = []
        dropped_small: list[OffloadKey] = []
        target_small = SMALL_SHARE * len(index)
        pop_small, pop_main, pop_index = small.popitem, main.popitem, index.pop
        # Queue lengths kept here, not asked of the dicts each turn: this loop is most of the
        # policy's cost.
        in_small, in_main = len(small), len(main)
        wanted, walked = count, 0
        while wanted:
            walked += 1
            if in_small and (in_small >= target_small or not in_main):
                key = pop_small(False)[0]
                in_small -= 1
                if skip and key in skip:
                    aside_small.append(key)
                elif freq[key]:
                    freq[key] = 0
                    main[key] = None
                    in_main += 1
                else:
                    del freq[key]
                    victims.append((key, pop_index(key)))
                    dropped_small.append(key)
                    wanted -= 1
            else:
                key = pop_main(False)[0]
                if skip and key in skip:
                    aside_main.append(key)
                    in_main -= 1
                elif freq[key]:
                    freq[key] -= 1
                    main[key] = None
                else:
                    del freq[key]
                    victims.append((key, pop_index(key)))
                    in_main -= 1
                    wanted -= 1
        for queue, aside in ((small, aside_small), (main, aside_main)):
            for key in reversed(aside):
                queue[key] = None
                queue.move_to_end(key, last=False)
        ghost = self._ghost
        append_all(ghost, dropped_small)
        drop_oldest(ghost, len(ghost) - self.capacity_blocks)
        self.entries_visited += walked
        return victims

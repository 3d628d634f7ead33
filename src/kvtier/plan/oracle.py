"""The reuse oracle: a real policy told which blocks are never wanted again — a bound, not a policy."""

from __future__ import annotations

from collections.abc import Collection, Container, Iterator, Sequence
from typing import Any

from kvtier.base import OffloadKey
from kvtier.plan.simulate import SimResult, simulate
from kvtier.policies.base import EvictionPolicy

__all__ = ["ReuseOracle", "last_reference", "reuse_oracle"]


def last_reference(chains: Sequence[Sequence[int]]) -> dict[int, int]:
    """Block id -> index of the last request whose chain names it."""
    last: dict[int, int] = {}
    for index, chain in enumerate(chains):
        for block in chain:
            last[block] = index
    return last


class ReuseOracle(EvictionPolicy):
    """Wraps a real policy and drops, before anything it would choose, the blocks that no
    later request names: it knows *whether* a block is referenced again, never *when*.

    This is the best an online policy could do with a perfect "will this block be reused?"
    predictor and its own order for everything else, so the gap between it and the wrapped
    policy is what better reuse prediction could still gain; the gap between it and Belady
    is what knowing the *time* of reuse adds. Planner-only: it needs the trace's future.

    :meth:`advance` (called by :func:`~kvtier.plan.simulate.simulate` before request ``i``)
    takes every block last named by request ``i - 1`` out of the wrapped policy into a dead
    set, which :meth:`evict` empties first. A dead block is never looked up again, so it
    cannot be hit, touched or protected. Cost: O(1) per block reference.
    """

    def __init__(self, inner: EvictionPolicy, chains: Sequence[Sequence[int]]):
        super().__init__(inner.capacity_blocks)
        self._inner = inner
        self._dead: dict[OffloadKey, int] = {}
        # ending[i]: the blocks whose last reference is request i
        self._ending: list[list[Any]] = [[] for _ in chains]  # int block ids, used as keys
        for block, index in last_reference(chains).items():
            self._ending[index].append(block)

    def advance(self, index: int) -> None:
        """Request ``index`` comes next: blocks last named before it are dead."""
        if index == 0:
            return
        remove, dead = self._inner.remove, self._dead
        for block in self._ending[index - 1]:
            block_id = remove(block)
            if block_id is not None:
                dead[block] = block_id

    def get(self, key: OffloadKey) -> int | None:
        block_id = self._inner.get(key)
        return self._dead.get(key) if block_id is None else block_id

    def contains(self, key: OffloadKey) -> bool:
        return self._inner.contains(key) or key in self._dead

    def insert(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._inner.insert(keys, block_ids)

    def remove(self, key: OffloadKey) -> int | None:
        block_id = self._dead.pop(key, None)
        return self._inner.remove(key) if block_id is None else block_id

    def touch(self, keys: Collection[OffloadKey]) -> None:
        self._inner.touch(keys)

    def refresh(self, keys: Collection[OffloadKey]) -> None:
        self._inner.refresh(keys)

    def request_finished(self, keys: Collection[OffloadKey], reused: Collection[OffloadKey]) -> None:
        self._inner.request_finished(keys, reused)

    def hold(self, key: OffloadKey) -> None:
        self._inner.hold(key)  # a dead key is in no request: nothing holds it

    def release(self, key: OffloadKey) -> None:
        self._inner.release(key)

    def _take(
        self, count: int, rest: list[tuple[OffloadKey, int]] | None
    ) -> list[tuple[OffloadKey, int]] | None:
        if rest is None:
            return None
        dead = self._dead
        self.entries_visited += count
        return [dead.popitem() for _ in range(count)] + rest

    def evict(self, count: int, skip: Container[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        from_dead = min(count, len(self._dead))  # dead keys are in no request, so never skipped
        rest = self._inner.evict(count - from_dead, skip) if count > from_dead else []
        return self._take(from_dead, rest)

    def evict_unheld(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> list[tuple[OffloadKey, int]] | None:
        from_dead = min(count, len(self._dead))
        rest = self._inner.evict_unheld(count - from_dead, protected) if count > from_dead else []
        return self._take(from_dead, rest)

    def evictable_blocks(self) -> int:
        return len(self._dead) + self._inner.evictable_blocks()

    def __len__(self) -> int:
        return len(self._dead) + len(self._inner)

    def __iter__(self) -> Iterator[OffloadKey]:
        yield from self._dead
        yield from self._inner


def reuse_oracle(chains: Sequence[Sequence[int]], policy: type[EvictionPolicy], capacity: int) -> SimResult:
    """Hits of ``policy`` at ``capacity`` when blocks never referenced again are evicted first."""
    oracle = ReuseOracle(policy(capacity), chains)
    return simulate(chains, oracle, capacity, on_request=oracle.advance)

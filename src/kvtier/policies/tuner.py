"""Choosing a policy's setting online by racing small copies of it on a sample of the keys."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier.base import OffloadKey
from kvtier.policies.base import EvictionPolicy

__all__ = ["Shadow", "SettingTuner"]

#: the smallest shadow cache sampling may shrink to: smaller ones let one lucky chain swing
#: the score, larger ones cost small caches a high sampling rate
MIN_SHADOW_BLOCKS = 64
#: at most one key in 2**MAX_SAMPLE_SHIFT is sampled: 1/32 keeps the shadows' cost a small
#: fraction of the policy's own, and a shadow of a large cache still holds thousands of blocks
MAX_SAMPLE_SHIFT = 5
#: sampled references fed to the shadows at once (one eviction round per batch, not per
#: key), and at most this share of a shadow's blocks, so a batch never flushes a shadow
BATCH_KEYS = 64
BATCH_SHARE = 1 / 8
#: the score forgets with a time constant of this many sampled references, so the choice
#: follows a workload that changes, and a phase long past does not outvote the present
SCORE_WINDOW = 4096
#: an odd 32-bit constant: the sample bits are taken from the middle of ``_stable_hash(key) * _MIX``,
#: so integer ids that follow a pattern (a trace's consecutive ids, chains of 16) still
#: sample evenly; an engine's digest keys hash uniformly either way
_MIX = 0x9E3779B1


def _stable_hash(key: object) -> int:
    """A key's hash that is the same in every process: Python's ``hash`` of bytes changes
    with ``PYTHONHASHSEED``, which made the sample, hence the race, differ run to run. An
    offload key starts with a digest, so its first 8 bytes are already uniform."""
    if key.__class__ is bytes:
        return int.from_bytes(key[:8], "little")
    return hash(key)


class Shadow:
    """One policy instance driven as a cache of keys only: what would it hit?

    :meth:`reference` looks each key up and counts those found as hits, stores the rest
    (evicting the policy's own victims for room, never a found key, as the manager passes
    over an offer's present keys), then ends the batch as a request ends: the found keys are
    its reused ones (``request_finished``). Block ids are slot numbers of a pretend tier,
    reused as keys leave. Nothing is held, nothing moves.
    """

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.score = 0.0
        self._free = list(range(policy.capacity_blocks))

    def reference(self, keys: Sequence[OffloadKey]) -> int:
        """Reference distinct ``keys``; the number found."""
        policy = self.policy
        contains = policy.contains
        found = [key for key in keys if contains(key)]
        reused = set(found)
        if len(found) == len(keys):
            policy.request_finished(keys, reused)
            return len(found)
        missing = [key for key in keys if key not in reused] if found else list(keys)
        del missing[policy.capacity_blocks :]
        free = self._free
        shortfall = len(missing) - len(free)
        if shortfall > 0:
            victims = policy.evict_unheld(shortfall, reused)
            if victims is None:  # the found keys fill the copy: let them go too
                victims = policy.evict_unheld(shortfall)
            if victims is None:  # cannot happen: nothing is held and the batch fits
                raise RuntimeError(f"{type(policy).__name__} refused to evict {shortfall} blocks")
            free.extend(block_id for _, block_id in victims)
        slots = free[-len(missing) :]
        del free[-len(missing) :]
        policy.insert(missing, slots)
        policy.request_finished(keys, reused)
        return len(found)


class SettingTuner:
    """Races one shadow per candidate setting and tells its owner which one leads.

    The idea is the miniature simulation of cache studies: a cache of ``capacity`` blocks
    fed one key in ``2**shift`` (by a hash of the key, so a sampled key is always sampled and
    its every reference seen) behaves like a cache of ``capacity >> shift`` blocks fed the
    sample, so shadows that small predict which setting would hit most at full size. Each
    shadow is a real policy instance built by ``make(setting, shadow_blocks)`` — the policy
    under test, not a model of it. Scores are hits, decayed over ``SCORE_WINDOW`` sampled
    references; after each batch the leader is compared with the setting in force, and
    ``apply(setting)`` is called when another one scores strictly higher.

    Cost per key the owner names: one hash and a compare, plus ``len(settings) / 2**shift``
    shadow references (each O(1) amortized); memory is the shadows', about
    ``len(settings) / 2**shift`` of the owner's.
    """

    def __init__(
        self,
        capacity_blocks: int,
        settings: Sequence[float],
        initial: float,
        make: Callable[[float, int], EvictionPolicy],
        apply: Callable[[float], None],
    ):
        shift = 0
        while shift < MAX_SAMPLE_SHIFT and capacity_blocks >> (shift + 1) >= MIN_SHADOW_BLOCKS:
            shift += 1
        #: keys are sampled when ``_stable_hash(key) * _MIX >> 20`` has these bits clear
        self.sample_mask = (1 << shift) - 1
        self.shadow_blocks = max(1, capacity_blocks >> shift)
        self.batch_keys = max(1, min(BATCH_KEYS, int(self.shadow_blocks * BATCH_SHARE)))
        self.settings = tuple(settings)
        self.shadows = [Shadow(make(setting, self.shadow_blocks)) for setting in self.settings]
        self.current = self.settings.index(initial)
        #: how many times the setting in force changed
        self.changes = 0
        self._apply = apply
        self._pending: list[OffloadKey] = []
        self._keep = 1.0 - 1.0 / SCORE_WINDOW

    @property
    def setting(self) -> float:
        """The setting in force."""
        return self.settings[self.current]

    @property
    def entries_visited(self) -> int:
        """Entries the shadows' evictions examined: the race's share of the owner's cost."""
        return sum(shadow.policy.entries_visited for shadow in self.shadows)

    def observe(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` were referenced (found and touched, or stored) by the owner."""
        mask, pending = self.sample_mask, self._pending
        if mask:
            pending.extend([key for key in keys if not (_stable_hash(key) * _MIX >> 20) & mask])
        else:
            pending.extend(keys)
        if len(pending) >= self.batch_keys:
            self._race()

    def _race(self) -> None:
        batch = list(dict.fromkeys(self._pending))  # a key named twice is one reference
        self._pending.clear()
        keep = self._keep ** len(batch)
        shadows = self.shadows
        for shadow in shadows:
            shadow.score = shadow.score * keep + shadow.reference(batch)
        leader = self.current
        for index, shadow in enumerate(shadows):
            if shadow.score > shadows[leader].score:
                leader = index
        if leader != self.current:
            self.current = leader
            self.changes += 1
            self._apply(self.settings[leader])

"""A lower tier that cannot answer a lookup from local state (a remote store) answers ``None``:
the stack manager answers ``None`` too, and the tier finds out at ``on_schedule_end``."""

import numpy as np
import xxhash

from helpers import key, payload, read_blocks, store_blocks
from kvtier.base import ReqContext
from kvtier.config import CascadeConfig
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend, MemoryTier

CTX = ReqContext("r")
BLOCK = 64


class AskingTier(MemoryTier):
    """A MemoryTier that knows nothing until asked: a key it has not been asked about looks
    up ``None`` and is queued; ``on_schedule_end`` answers every queued key at once."""

    def __init__(self, *args):
        super().__init__(*args)
        self.known: set = set()
        self.asked: list = []
        self.batches: list[list] = []

    def lookup(self, k):
        if k in self.known:
            return super().lookup(k)
        if k not in self.asked:
            self.asked.append(k)
        return None

    def on_schedule_end(self):
        if self.asked:
            self.batches.append(list(self.asked))
            self.known.update(self.asked)
            # what the "server" holds that this process did not know of joins its index
            found = [k for k in self.asked if k in self._blocks and not self._policy.contains(k)]
            self._policy.insert(found, [0] * len(found))
            self.asked.clear()


def make():
    backend = MemoryBackend(4, BLOCK)
    tier = AskingTier("remote", backend.rows, 16)
    return TierStackManager(backend, LRUPolicy(4), [tier], CascadeConfig(write_policy="write_through")), tier


def test_unknown_keys_look_up_none_and_are_asked_once_per_step():
    manager, tier = make()
    absent = [key(i) for i in range(3)]
    assert [manager.lookup(k, CTX) for k in absent] == [None] * 3
    assert manager.lookup(absent[0], CTX) is None  # asked again in the same step: still one question
    manager.on_schedule_end()
    assert tier.batches == [absent]  # one batch for the step
    assert [manager.lookup(k, CTX) for k in absent] == [False] * 3
    assert manager.stats()["misses"] == 3


def test_a_key_the_tier_finds_is_promoted_with_its_bytes():
    manager, tier = make()
    k = key(7)
    # another engine's block: on the tier, not known to this process
    tier._blocks[k] = (payload(k, BLOCK).tobytes(), xxhash.xxh3_64_intdigest(payload(k, BLOCK)))
    assert manager.lookup(k, CTX) is None  # unknown
    manager.on_schedule_end()  # the tier asks
    assert manager.lookup(k, CTX) is None  # found: its promotion is queued
    manager.on_schedule_end()  # the read is submitted
    manager.on_schedule_end()  # and polled
    assert manager.lookup(k, CTX) is True
    (got,) = read_blocks(manager, [k], CTX)
    assert np.array_equal(got, payload(k, BLOCK))


def test_stored_blocks_still_go_down():
    manager, tier = make()
    keys = [key(20), key(21)]
    store_blocks(manager, keys, CTX)
    for _ in range(3):
        manager.on_schedule_end()
    assert set(keys) <= set(tier._blocks)

"""The single-tier manager against a plain-dict model, under random call sequences.

Every store writes the key's own bytes into the slots it was given; every load reads them back
and compares, when it starts and when it completes, so a slot reused too early shows up as
wrong bytes, not just as a wrong count.
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import key, payload
from kvtier.base import ReqContext
from kvtier.manager.single import SingleTierManager
from kvtier.policies import get_policy_class, registered_policies
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryBackend

CAPACITY = 5
BLOCK = 32
KEYS = [key(i) for i in range(12)]
CTX = ReqContext("r")

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)


class SingleTierMachine(RuleBasedStateMachine):
    policy_cls: type = LRUPolicy

    def __init__(self):
        super().__init__()
        self.manager = SingleTierManager(MemoryBackend(CAPACITY, BLOCK), self.policy_cls(CAPACITY))
        self.rows = self.manager.backend.rows
        self.ready: set = set()  # the model: keys lookup must see
        self.pending: set = set()
        self.pins: dict = {}
        self.store_jobs: list = []  # keys offered per prepare_store, not yet completed
        self.load_jobs: list = []  # (keys, block ids) per prepare_load, not yet completed
        self.visible_by_events: set = set()

    def check_rows(self, keys, block_ids):
        for k, block_id in zip(keys, block_ids):
            np.testing.assert_array_equal(self.rows[block_id], payload(k, BLOCK))

    @rule(k=st.sampled_from(KEYS))
    def lookup(self, k):
        assert self.manager.lookup(k, CTX) is (k in self.ready)

    @rule(keys=key_lists)
    def prepare_store(self, keys):
        offered = list(dict.fromkeys(keys))
        new = [k for k in offered if k not in self.ready and k not in self.pending]
        evictable = [k for k in self.ready if k not in self.pins and k not in offered]
        free = CAPACITY - len(self.ready) - len(self.pending)
        out = self.manager.prepare_store(keys, CTX)
        if len(new) > free + len(evictable):
            assert out is None
            return
        assert out is not None
        assert out.keys_to_store == new
        assert len(out.evicted_keys) == max(0, len(new) - free)
        assert set(out.evicted_keys) <= set(evictable)
        self.ready -= set(out.evicted_keys)
        self.pending |= set(new)
        for k, block_id in zip(new, out.store_spec.block_ids):
            self.rows[block_id] = payload(k, BLOCK)  # the worker writes
        self.store_jobs.append(offered)

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        keys = self.store_jobs.pop(data.draw(st.integers(0, len(self.store_jobs) - 1)))
        self.manager.complete_store(keys, CTX, success)
        written = {k for k in keys if k in self.pending}
        self.pending -= written
        if success:
            self.ready |= written

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def prepare_load(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        spec = self.manager.prepare_load(keys, CTX)
        self.check_rows(keys, spec.block_ids)
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1
        self.load_jobs.append((keys, spec.block_ids.tolist()))

    @precondition(lambda self: self.load_jobs)
    @rule(data=st.data())
    def complete_load(self, data):
        keys, block_ids = self.load_jobs.pop(data.draw(st.integers(0, len(self.load_jobs) - 1)))
        self.check_rows(keys, block_ids)  # nobody wrote over the slots while they were read
        self.manager.complete_load(keys, CTX)
        for k in keys:
            self.pins[k] -= 1
            if not self.pins[k]:
                del self.pins[k]

    @rule(keys=key_lists)
    def touch(self, keys):
        self.manager.touch(keys, CTX)

    @precondition(lambda self: not self.store_jobs and not self.load_jobs)
    @rule()
    def reset_cache(self):
        self.manager.reset_cache()
        self.ready.clear()

    @rule()
    def schedule_step(self):
        self.manager.on_schedule_end()

    @invariant()
    def counts_match(self):
        stats = self.manager.stats()
        assert stats["ready_blocks"] == len(self.ready)
        assert stats["pending_blocks"] == len(self.pending)
        assert stats["held_blocks"] == len(self.pins)
        assert stats["free_blocks"] == CAPACITY - len(self.ready) - len(self.pending)

    @invariant()
    def events_replay_to_the_ready_set(self):
        for event in self.manager.take_events():
            if event.metadata_only:  # a failed store's retraction: never visible
                assert event.removed and not set(event.keys) & self.visible_by_events
            elif event.removed:
                assert set(event.keys) <= self.visible_by_events
                self.visible_by_events -= set(event.keys)
            else:
                assert not set(event.keys) & self.visible_by_events
                self.visible_by_events |= set(event.keys)
        assert self.visible_by_events == self.ready


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
# The newer policies get fewer examples each, so the whole file stays within seconds.
SETTINGS_NEWER = settings(max_examples=40, stateful_step_count=40, deadline=None)

# One state machine per registered policy: every manager invariant must hold whichever
# policy orders the tier.
for _name in registered_policies():
    _machine = type(f"{_name}Machine", (SingleTierMachine,), {"policy_cls": get_policy_class(_name)})
    _case = _machine.TestCase
    _case.settings = SETTINGS if _name in ("lru", "arc") else SETTINGS_NEWER
    globals()[f"Test{_name.upper()}ManagerStateful"] = _case
del _name, _machine, _case

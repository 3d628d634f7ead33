"""The tier-stack manager under random call sequences, with a disk tier that fails and rots.

What is checked, whatever the sequence: every byte served from the CPU tier is the key's own
(read when the load starts and again when it completes); a block the disk tier has not saved
(and did not refuse) is never dropped from the CPU tier; the CPU tier's rows are all accounted
for; the disk tier never holds more than its capacity. A variant adds a victim tier below the
disk (``receives: evicted``): a block leaving the CPU tier that the disk does not keep must
reach it (or be refused by it), and it never gets a block the disk keeps.
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier_testing import key, payload
from kvtier.base import ReqContext
from kvtier.config import CascadeConfig
from kvtier.manager.causes import CAUSES, MissCauses
from kvtier.manager.stack import TierStackManager
from kvtier.policies import get_policy_class, registered_policies
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.lru import LRUPolicy
from kvtier.testing import MemoryTier
from kvtier.testing import MemoryBackend

# hypothesis's state machines: seconds each, so out of the quick `-m "not slow"` loop
pytestmark = pytest.mark.slow

CPU_BLOCKS = 4
DISK_BLOCKS = 6
BLOCK = 32
KEYS = [key(i) for i in range(10)]
CTX = ReqContext("r")
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)


class RecordingAdmission(AdmissionFilter):
    """``admit: reuse``, remembering which keys it refused (so the model may allow their drop)."""

    def __post_init__(self):
        super().__post_init__()
        self.refused_keys: set = set()

    def admit(self, key):
        ok = super().admit(key)
        if not ok:
            self.refused_keys.add(key)
        return ok


class StackMachine(RuleBasedStateMachine):
    policy_cls: type = LRUPolicy
    write_policy = "write_back"
    admit = "all"
    #: > 0: a victim tier of this many blocks below the disk
    victim_blocks = 0

    def __init__(self):
        super().__init__()
        backend = MemoryBackend(CPU_BLOCKS, BLOCK)
        self.disk = MemoryTier("disk", backend.rows, DISK_BLOCKS)
        self.admission = RecordingAdmission(self.admit, min_reuse=2, sketch_width=64)
        tiers, admission, receives = [self.disk], [self.admission], ["saved"]
        self.victim = None
        if self.victim_blocks:
            self.victim = MemoryTier("victim", backend.rows, self.victim_blocks)
            self.victim.medium = "VICTIM_STORE"  # its events told apart from the disk's
            tiers.append(self.victim)
            admission.append(None)
            receives.append("evicted")
        self.manager = TierStackManager(
            backend,
            self.policy_cls(CPU_BLOCKS),
            tiers,
            CascadeConfig(write_policy=self.write_policy, max_demote_bytes_per_step=2 * BLOCK),
            admission=admission,
            receives=receives,
            causes=MissCauses(256, ["cpu", *(tier.name for tier in tiers)]),
        )
        self.rows = backend.rows
        self.store_jobs: list = []
        self.load_jobs: list = []
        self.evicted_below: set = set()  # keys the disk tier dropped by its own policy
        self.evicted_from_victim: set = set()  # keys the victim tier dropped by its own policy

    def check_rows(self, keys, rows):
        for k, row in zip(keys, rows):
            np.testing.assert_array_equal(self.rows[row], payload(k, BLOCK))

    @rule(keys=key_lists)
    def store(self, keys):
        out = self.manager.prepare_store(keys, CTX)
        if out is None:
            return
        for k, row in zip(out.keys_to_store, out.store_spec.block_ids):
            self.rows[row] = payload(k, BLOCK)  # the worker copies the GPU block in
        self.store_jobs.append(list(keys))

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        keys = self.store_jobs.pop(data.draw(st.integers(0, len(self.store_jobs) - 1)))
        self.manager.complete_store(keys, CTX, success)

    @rule(keys=key_lists)
    def load(self, keys):
        ready = [k for k in dict.fromkeys(keys) if self.manager.lookup(k, CTX) is True]
        if not ready:
            return
        spec = self.manager.prepare_load(ready, CTX)
        rows = spec.block_ids.tolist()
        self.check_rows(ready, rows)
        self.load_jobs.append((ready, rows))

    @precondition(lambda self: self.load_jobs)
    @rule(data=st.data())
    def complete_load(self, data):
        keys, rows = self.load_jobs.pop(data.draw(st.integers(0, len(self.load_jobs) - 1)))
        self.check_rows(keys, rows)  # nothing overwrote the rows while they were read
        self.manager.complete_load(keys, CTX)

    @rule(keys=key_lists)
    def touch(self, keys):
        self.manager.touch(keys, CTX)

    @rule()
    def step(self):
        self.manager.on_schedule_end()

    @rule(reason=st.sampled_from(["EIO", "ENOSPC"]))
    def disk_fails_next_job(self, reason):
        self.disk.fail_next(1, reason)

    @precondition(lambda self: self.victim is not None)
    @rule(reason=st.sampled_from(["EIO", "ENOSPC"]))
    def victim_fails_next_job(self, reason):
        self.victim.fail_next(1, reason)

    @rule(k=st.sampled_from(KEYS))
    def disk_rots(self, k):
        if self.disk.lookup(k) is True:
            self.disk.corrupt(k)

    @precondition(lambda self: not self.store_jobs and not self.load_jobs)
    @rule()
    def reset_cache(self):
        self.dirty_never_dropped()  # reset may drop anything; check what came before
        self.manager.reset_cache()
        list(self.manager.take_events())

    @invariant()
    def admission_counted_in_stats(self):
        figures = self.manager.stats()
        assert figures["disk.refused_blocks"] == self.admission.refused >= len(self.admission.refused_keys)
        assert figures["disk.admitted_blocks"] == self.admission.admitted
        if self.admit == "all":
            assert self.admission.refused == 0

    @invariant()
    def dirty_never_dropped(self):
        events = list(self.manager.take_events())
        for event in events:  # the disk may have made room by dropping its own oldest
            if event.medium == self.disk.medium and event.removed:
                self.evicted_below.update(event.keys)
            if self.victim is not None and event.medium == self.victim.medium:
                if event.removed:
                    self.evicted_from_victim.update(event.keys)
                else:
                    for k in event.keys:
                        assert self.disk.lookup(k) is not True, "the victim got a block the disk keeps"
        for event in events:
            if event.medium == "MEMORY" and event.removed and not event.metadata_only:
                for k in event.keys:
                    if self.victim is not None:
                        # what the disk does not keep, whatever the reason, goes to the victim
                        assert (
                            self.disk.lookup(k) is True
                            or k in self.evicted_below
                            or self.victim.lookup(k) is True
                            or k in self.victim.refused_keys
                            or k in self.evicted_from_victim
                        ), "a block the victim tier could take was dropped from the CPU tier"
                        continue
                    assert (
                        self.disk.lookup(k) is True
                        or k in self.disk.refused_keys
                        or k in self.evicted_below
                        or k in self.admission.refused_keys
                    ), "a block the disk could take was dropped from the CPU tier"

    @invariant()
    def each_miss_has_one_cause(self):
        stats = self.manager.stats()
        assert sum(stats[f"miss_{cause}"] for cause in CAUSES) == stats["misses"]
        per_tier = sum(stats[f"{name}.miss_{cause}"] for name in ("cpu", "disk") for cause in CAUSES[1:])
        assert per_tier <= stats["misses"] - stats["miss_new"]

    @invariant()
    def cpu_rows_accounted_for(self):
        stats = self.manager.stats()
        used = stats["ready_blocks"] + stats["pending_blocks"] + stats["promoting_blocks"]
        assert used + stats["free_blocks"] == CPU_BLOCKS

    @invariant()
    def disk_within_capacity(self):
        assert self.disk.num_blocks() <= DISK_BLOCKS
        if self.victim is not None:
            assert self.victim.num_blocks() <= self.victim_blocks


SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None)
# The newer policies get fewer examples each, so the whole file stays within seconds.
SETTINGS_NEWER = settings(max_examples=40, stateful_step_count=50, deadline=None)

# Every registered policy under both write policies: each manager invariant must hold
# whichever policy orders the CPU tier.
for _name in registered_policies():
    for _write in ("write_back", "write_through"):
        _machine = type(
            f"{_name}_{_write}Machine",
            (StackMachine,),
            {"policy_cls": get_policy_class(_name), "write_policy": _write},
        )
        _case = _machine.TestCase
        _case.settings = SETTINGS if _name in ("lru", "arc") else SETTINGS_NEWER
        _title = _write.title().replace("_", "")
        globals()[f"TestStack{_name.upper()}{_title}"] = _case
del _name, _write, _machine, _case, _title


class ReuseAdmissionMachine(StackMachine):
    """The disk admits a block only once it was offered or looked up twice."""

    admit = "reuse"


TestStackLRUWriteBackAdmitReuse = ReuseAdmissionMachine.TestCase
TestStackLRUWriteBackAdmitReuse.settings = SETTINGS_NEWER


class VictimTierMachine(StackMachine):
    """Below the disk (a mirror), a victim tier (``receives: evicted``) that fails and evicts
    too. The disk takes every block, or (``admit: reuse``) only blocks wanted twice."""

    victim_blocks = 5


for _write, _admit in (("write_back", "all"), ("write_through", "all"), ("write_back", "reuse")):
    _case = type(
        f"Victim{_write}{_admit}Machine", (VictimTierMachine,), {"write_policy": _write, "admit": _admit}
    ).TestCase
    _case.settings = SETTINGS if _admit == "all" else SETTINGS_NEWER
    _title = _write.title().replace("_", "") + ("AdmitReuse" if _admit == "reuse" else "")
    globals()[f"TestStackLRU{_title}VictimTier"] = _case
del _write, _admit, _case, _title

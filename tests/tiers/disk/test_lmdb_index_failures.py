"""lmdb: reservations a failed publish could not give back are given back by the next job.

Seen for real in ``kvtier soak --faults`` (lmdb, filesystem filled)::

    publishing of job 86 failed in the LMDB index (mdb_txn_commit: No space left on device)
    could not give back 8 reserved slots; the next process to open the store alone (or
    `kvtier check --fix`) recovers them

so until a restart the slab was 8 slots smaller, and more with every such job. Whether a real
ENOSPC lands on the publish commit, rather than on the prologue's, depends on which pages LMDB
can reuse, so here the index's write transactions are made to fail (the errno LMDB reports)
from the first block write of one job until the job is over — exactly that window.
"""

from __future__ import annotations

import lmdb
from kvtier_testing import key
from kvtier_testing.store import load, open_tier, store


class _FailingWrites:
    """The tier's LMDB environment, whose write transactions fail while ``failing`` is set."""

    def __init__(self, env):
        self._env = env
        self.failing = False

    def begin(self, *args, **kwargs):
        if kwargs.get("write") and self.failing:
            raise lmdb.Error("mdb_txn_commit: No space left on device")
        return self._env.begin(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_slots_of_a_failed_publish_come_back_with_the_next_job(tmp_path, shm):
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 16)
    committed = [key(i) for i in range(4)]
    assert store(tier, shm.rows, committed).success
    env = tier._env = _FailingWrites(tier._env)
    real_block = tier._store_block

    def block_then_fail(job, index):
        env.failing = True  # the prologue has reserved; publish and give-back will fail
        return real_block(job, index)

    tier._store_block = block_then_fail
    new = [key(i) for i in range(10, 18)]
    result = store(tier, shm.rows, new, first_row=10)
    assert {k: reason.counter for k, reason in result.failed.items()} == {k: "ENOSPC" for k in new}
    tier._store_block = real_block
    env.failing = False

    again = [key(i) for i in range(20, 28)]
    assert store(tier, shm.rows, again, first_row=20).success  # its prologue gives the 8 back
    report = tier.check()
    assert report.healthy, report.problems  # before: "8 slots reserved by processes no longer writing them"
    result = load(tier, shm.rows, committed + again, first_row=30)
    assert result.success
    # every slot is usable again: the store fills to its capacity exactly
    rest = [key(i) for i in range(40, 40 + 16 - len(committed) - len(again))]
    assert store(tier, shm.rows, rest, first_row=40).success
    assert tier.num_blocks() == 16 and tier.stats()["evicted"] == 0
    tier.close()

"""What only the lmdb tier has: the slab, slot bookkeeping and its recovery."""

import pytest
from kvtier_testing import key
from kvtier_testing.store import dead_pid, holds, load, open_tier, store

from kvtier.errors import IndexDamagedError
from kvtier.tiers.disk.lmdb import _ENTRY, _NEXT_SLOT, _OWNER, _slot_key


def test_slab_is_preallocated_and_slots_are_reused(tmp_path, shm):
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 4)
    slab = tmp_path / "s" / "slab.kvs"
    assert slab.stat().st_size == 4 * tier.slot_bytes
    for i in range(12):
        assert store(tier, shm.rows, [key(i)], first_row=i).success
    assert slab.stat().st_size == 4 * tier.slot_bytes
    with tier._env.begin() as txn:
        slots = sorted(_ENTRY.unpack(v)[0] for _, v in txn.cursor(db=tier._blocks))
        assert slots == [0, 1, 2, 3]
        assert _OWNER.unpack(txn.get(_NEXT_SLOT, db=tier._meta))[0] == 4
    assert load(tier, shm.rows, [key(i) for i in range(8, 12)], first_row=20).success
    tier.close()


def test_reservations_of_a_dead_writer_are_recovered(tmp_path, shm):
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 8)
    store(tier, shm.rows, [key(1)])
    with tier._env.begin(write=True) as txn:  # as a writer killed between reserve and publish
        txn.put(_slot_key(1), _OWNER.pack(dead_pid()), db=tier._reserved)
        txn.put(_NEXT_SLOT, _OWNER.pack(2), db=tier._meta)
    report = tier.check()
    assert report.problems == ["1 slots reserved by processes no longer writing them"]
    tier.close()
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 8)  # alone: recovers at open
    assert tier.check().healthy
    with tier._env.begin() as txn:
        assert txn.get(_slot_key(1), db=tier._free) is not None
    store(tier, shm.rows, [key(2)], first_row=1)
    assert load(tier, shm.rows, [key(1), key(2)], first_row=30).success
    tier.close()


def test_a_full_store_takes_back_what_a_dead_writer_reserved(tmp_path, shm):
    """Its slots come back at the next store that finds no room, not only at an open alone:
    a writer killed mid-write once left them reserved for the rest of every process's life."""
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 4)
    store(tier, shm.rows, [key(0), key(1)])
    with tier._env.begin(write=True) as txn:  # as a writer killed between reserve and publish
        for slot in (2, 3):
            txn.put(_slot_key(slot), _OWNER.pack(dead_pid()), db=tier._reserved)
        txn.put(_NEXT_SLOT, _OWNER.pack(4), db=tier._meta)
    assert store(tier, shm.rows, [key(2), key(3)], first_row=2).success  # no eviction needed
    assert tier.check().healthy
    keys = [key(i) for i in range(4)]
    assert load(tier, shm.rows, keys, first_row=20).success
    assert all(holds(shm.rows, 20 + i, k) for i, k in enumerate(keys))
    tier.close()


def test_check_fix_repairs_slot_bookkeeping(tmp_path, shm):
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 8)
    store(tier, shm.rows, [key(i) for i in range(3)])
    with tier._env.begin(write=True) as txn:
        txn.put(_NEXT_SLOT, _OWNER.pack(5), db=tier._meta)  # slots 3, 4: used by nobody
        txn.put(_slot_key(0), b"", db=tier._free)  # slot 0 holds key 0 but is marked free
        txn.put(_slot_key(2), _OWNER.pack(dead_pid()), db=tier._reserved)
    report = tier.check(fix=True)
    assert report.problems == [
        "1 slots holding indexed blocks are on the free list",
        "1 slots reserved by processes no longer writing them",
        "2 slots are neither indexed, free nor reserved (leaked)",
    ]
    assert len(report.fixed) == 3
    after = tier.check()
    assert after.healthy, after.problems
    keys = [key(0), key(1), key(2)]
    assert load(tier, shm.rows, keys, first_row=20).success  # no valid block was dropped
    assert all(holds(shm.rows, 20 + i, k) for i, k in enumerate(keys))
    # and the repaired free list hands out only the two truly free slots
    assert store(tier, shm.rows, [key(5), key(6)], first_row=5).success
    assert load(tier, shm.rows, keys + [key(5), key(6)], first_row=30).success
    tier.close()


def test_a_damaged_index_is_an_open_error_with_the_fix(tmp_path, shm):
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 4)
    tier.close()
    data = tmp_path / "s" / "index" / "data.mdb"
    data.write_bytes(b"\xde\xad" * 8192)
    with pytest.raises(IndexDamagedError, match=r"index damaged: .*no LMDB magic.*kvtier check .* --fix"):
        open_tier("lmdb", tmp_path / "s", shm.rows, 4)


def test_a_key_committed_by_another_writer_meanwhile_is_kept(tmp_path, shm):
    """The prologue finds the key already indexed: reported stored, nothing written."""
    tier = open_tier("lmdb", tmp_path / "s", shm.rows, 8)
    store(tier, shm.rows, [key(1)])
    with tier._env.begin(write=True) as txn:  # another process's commit of key 2 in slot 1
        value = txn.get(key(1), db=tier._blocks)
        txn.put(key(2), value, db=tier._blocks)
    result = store(tier, shm.rows, [key(2)], first_row=5)
    assert result.ok == [key(2)]
    assert tier.stats()["bytes_written"] == tier.slot_bytes  # only key 1's block was written
    tier.close()

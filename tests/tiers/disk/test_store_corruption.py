"""Damage on disk is a miss every time, never wrong bytes; check() finds it and fix drops it."""

import logging
import os

import pytest
import xxhash
from kvtier_testing import key, payload
from kvtier_testing.store import (
    BLOCK,
    KINDS,
    flip,
    fingerprint,
    holds,
    load,
    locate,
    open_tier,
    store,
)

from kvtier.tiers.disk.format import HEADER_BYTES, encode_header_into
from kvtier.tiers.base import Failure
from kvtier.tiers.disk.blockio import aligned_buffer


def flip_payload(tier, victim, other):
    path, offset = locate(tier, victim)
    flip(path, offset + HEADER_BYTES + BLOCK // 2)


def flip_header(tier, victim, other):
    path, offset = locate(tier, victim)
    flip(path, offset + 20)  # inside the layout digest


def truncate(tier, victim, other):
    path, offset = locate(tier, victim)
    os.truncate(path, offset + HEADER_BYTES + 100)


def other_layout(tier, victim, other):
    path, offset = locate(tier, victim)
    page = aligned_buffer(HEADER_BYTES)
    encode_header_into(
        page,
        layout_digest=fingerprint(model="another-model").digest(),
        key=victim,
        payload_bytes=BLOCK,
        checksum=xxhash.xxh3_64_intdigest(payload(victim, BLOCK)),
    )
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(page[:])


def swapped(tier, victim, other):
    """The victim's block replaced by another key's complete, valid block."""
    src, src_offset = locate(tier, other)
    dst, dst_offset = locate(tier, victim)
    with open(src, "rb") as f:
        f.seek(src_offset)
        data = f.read(tier.slot_bytes)
    if tier.kind == "files":
        with open(dst, "wb") as f:  # the other key's file, copied over the victim's
            f.write(data)
    else:
        with open(dst, "r+b") as f:
            f.seek(dst_offset)
            f.write(data)


DAMAGE = {
    flip_payload: Failure.corrupt("checksum"),
    flip_header: Failure.corrupt("header checksum"),
    truncate: Failure.corrupt("truncated"),
    other_layout: Failure.corrupt("other layout"),
    swapped: Failure.corrupt("other key"),
}


def last_stored(tier, keys):
    """The key whose block lies last on disk (so truncating there damages only it)."""
    return max(keys, key=lambda k: locate(tier, k)[1]) if tier.kind == "lmdb" else keys[-1]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_damage_is_a_miss_and_never_served(kind, damage, tmp_path, shm, caplog):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(6)]
    assert store(tier, shm.rows, keys).success
    victim = last_stored(tier, keys)
    other = next(k for k in keys if k != victim)
    damage(tier, victim, other)

    # a truncated slab is also reported as such (short of its capacity); a file is just a block
    slab_cut = damage is truncate and kind == "lmdb"
    report = tier.check()
    assert [p for p in report.problems if victim.hex() in p] != []
    assert len(report.problems) == (2 if slab_cut else 1)

    with caplog.at_level(logging.WARNING):
        result = load(tier, shm.rows, keys, first_row=20)
    assert result.failed == {victim: DAMAGE[damage]}
    assert result.ok == [k for k in keys if k != victim]
    for i, k in enumerate(keys):
        if k != victim:
            assert holds(shm.rows, 20 + i, k)
    assert tier.lookup(victim) is False
    removed = [k for e in tier.take_events() if e.removed for k in e.keys]
    assert victim in removed
    assert len([r for r in caplog.records if victim.hex() in r.getMessage()]) == 1  # logged once
    assert tier.stats()["corrupt"] == 1
    # dropped from the index too: a second try is a plain miss, and the store is healthy
    assert load(tier, shm.rows, [victim], first_row=30).failed == {victim: Failure.MISSING}
    after = tier.check(fix=True)
    assert len(after.problems) == (1 if slab_cut else 0)
    assert tier.check().healthy
    tier.close()
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    assert tier.lookup(victim) is False and tier.num_blocks() == 5
    tier.close()


@pytest.mark.parametrize("kind", KINDS)
def test_check_fix_drops_bad_blocks(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(4)]
    store(tier, shm.rows, keys)
    flip_payload(tier, keys[1], None)
    flip_header(tier, keys[2], None)
    report = tier.check(fix=True)
    assert len(report.problems) == 2 and report.fixed
    assert tier.lookup(keys[1]) is False and tier.lookup(keys[2]) is False
    assert tier.check().healthy
    assert load(tier, shm.rows, [keys[0], keys[3]], first_row=10).success
    # the freed room is usable again
    assert store(tier, shm.rows, [key(10), key(11)], first_row=4).success
    tier.close()

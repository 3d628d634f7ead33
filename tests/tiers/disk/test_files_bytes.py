"""A ``files`` tier with ``lossless``: blocks take their own pages, so the bytes hold more.

The store counts 4096-byte pages (``usage``), names each block file with its pages, and never
lets its files take more than ``capacity``; every block read back is the one stored.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvtier_testing import key, kv_payload, payload
from kvtier_testing.store import load, open_tier, region, run

from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.format import PAGE_BYTES, on_disk_block_bytes

#: 17 pages a block raw (its header page included); about 13 with lossless on KV
BLOCK = 64 * 1024
#: raw blocks the capacity holds
N = 16
CAPACITY = N * on_disk_block_bytes(BLOCK)


@pytest.fixture
def rows():
    made = region(16, BLOCK)
    yield made.rows
    made.close()


def files_bytes(path) -> int:
    """What the store's block directories hold, temp files included."""
    return sum(p.stat().st_size for p in (path / "blocks").rglob("*") if p.is_file())


def usage(path) -> int:
    return int.from_bytes((path / "usage").read_bytes()[:8], "little")


def fill(tier, rows, keys, make) -> None:
    """Store ``keys`` four at a time (each job evicting the coldest for room)."""
    for first in range(0, len(keys), 4):
        batch = keys[first : first + 4]
        for row, k in enumerate(batch):
            rows[row] = make(k, BLOCK)
        assert run(tier, batch, range(len(batch)), load=False).success


def filled(tmp_path, rows, count: int, make=kv_payload, codec: str = "lossless"):
    """A store of ``N`` raw blocks' bytes, offered ``count`` keys' blocks: its path, the keys, the tier."""
    path = tmp_path / "s"
    keys = [key(i) for i in range(count)]
    tier = open_tier("files", path, rows, N, codec=codec)
    fill(tier, rows, keys, make)
    return path, keys, tier


def held_exactly(tier, rows, keys, make) -> list[bytes]:
    """The keys the tier holds, each loaded and compared byte for byte with what was stored."""
    held = [k for k in keys if tier.lookup(k)]
    for first in range(0, len(held), 8):
        batch = held[first : first + 8]
        assert load(tier, rows, batch, first_row=8).success
        for row, k in enumerate(batch, start=8):
            assert np.array_equal(rows[row], make(k, BLOCK)), k.hex()
    return held


def test_lossless_on_kv_holds_more_blocks_than_raw_in_the_same_bytes(tmp_path, rows):
    path, keys, tier = filled(tmp_path, rows, 3 * N)
    held = held_exactly(tier, rows, keys, kv_payload)
    stats = tier.stats()
    # 13 pages a block where a raw one takes 17; a job is admitted with a raw block's room
    # for each key (the most it may take), so the store is full but for one job's worst case
    assert len(held) == stats["blocks"] > 1.15 * N
    assert stats["held_bytes"] > CAPACITY - 4 * tier.slot_bytes
    assert held == keys[-len(held) :]  # the newest: eviction took the oldest, and only for room
    assert stats["codec_block_bytes"] / stats["codec_stored_bytes"] > 1.35  # the ratio achieved
    # the blocks its bytes hold at the sizes achieved
    assert stats["capacity_blocks"] == CAPACITY * len(held) // stats["held_bytes"] >= len(held)
    assert files_bytes(path) <= stats["held_bytes"] == usage(path) * PAGE_BYTES <= CAPACITY
    # each file's name says the pages its block takes
    named = {}
    for p in (path / "blocks").rglob("*.kvb"):
        hexed, pages, _ = p.name.split(".")
        named[bytes.fromhex(hexed)] = int(pages)
        assert p.stat().st_size <= int(pages) * PAGE_BYTES
    encoded = {k: len(tier.codec.encode(kv_payload(k, BLOCK))) for k in held}
    assert named == {k: on_disk_block_bytes(size) // PAGE_BYTES for k, size in encoded.items()}
    tier.close()

    report = check_store(str(path))  # `kvtier check`: the names' sizes agree with the files
    assert report.healthy and report.blocks_checked == len(held), report.problems
    tier = open_tier("files", path, rows, N, codec="lossless")  # the recount reads the names
    assert tier.num_blocks() == len(held) and usage(path) * PAGE_BYTES == stats["held_bytes"]
    assert tier.capacity_blocks == stats["capacity_blocks"]
    assert held_exactly(tier, rows, keys, kv_payload) == held
    tier.close()


def test_lossless_on_incompressible_bytes_holds_what_raw_does_and_no_more(tmp_path, rows):
    path, keys, tier = filled(tmp_path, rows, 3 * N, payload)
    held = held_exactly(tier, rows, keys, payload)
    assert len(held) == N and held == keys[-N:]
    assert files_bytes(path) <= usage(path) * PAGE_BYTES == CAPACITY
    tier.close()


def test_a_lowered_capacity_trims_the_oldest_blocks_to_the_bytes(tmp_path, rows):
    path, keys, tier = filled(tmp_path, rows, 20)
    tier.close()
    tier = open_tier("files", path, rows, N // 2, codec="lossless")  # alone: trimmed at open
    held = held_exactly(tier, rows, keys, kv_payload)
    # the newest jobs' (a job's blocks share one recency stamp)
    assert N // 2 < len(held) < 20 and set(keys[-8:]) <= set(held) <= set(keys[-12:])
    assert files_bytes(path) <= usage(path) * PAGE_BYTES <= CAPACITY // 2
    tier.close()


def test_check_finds_a_name_that_understates_its_block_and_a_low_count(tmp_path, rows):
    path, keys, tier = filled(tmp_path, rows, 4)
    tier.close()
    named = next((path / "blocks").rglob(f"{keys[0].hex()}.*.kvb"))
    liar = named.with_name(f"{keys[0].hex()}.2.kvb")  # 8 KiB, for a block of 13 pages
    os.rename(named, liar)
    (path / "usage").write_bytes((3).to_bytes(8, "little"))  # too low: a bug, never a crash
    report = check_store(str(path))
    text = "\n".join(report.problems)
    assert "more than the 8192 it is counted at" in text
    assert "usage count says 3 pages" in text
    fixed = check_store(str(path), fix=True)
    assert fixed.fixed
    assert not liar.exists() and check_store(str(path)).healthy
    assert usage(path) * PAGE_BYTES >= files_bytes(path)
    tier = open_tier("files", path, rows, N, codec="lossless")
    assert held_exactly(tier, rows, keys, kv_payload) == keys[1:]
    tier.close()


@pytest.mark.parametrize(
    ("first", "then"), [("lossless", "int8"), ("int8", "lossless"), ("lossless", "none")]
)
def test_a_store_of_another_codec_is_never_decoded_as_its_own(tmp_path, rows, first, then):
    path, keys, tier = filled(tmp_path, rows, 4, codec=first)
    tier.close()
    tier = open_tier("files", path, rows, N, codec=then)  # wiped: another layout
    assert tier.num_blocks() == 0 and not load(tier, rows, keys, first_row=8).ok
    fill(tier, rows, keys, kv_payload)
    assert len(held_exactly(tier, rows, keys, kv_payload if then != "int8" else decoded_int8(tier))) == 4
    tier.close()


def decoded_int8(tier):
    """What an int8 tier gives back for a key: the codec's decode of its block."""
    return lambda k, nbytes: tier.codec.decode(tier.codec.encode(kv_payload(k, nbytes)))


def test_lossless_on_lmdb_keeps_raw_slots_and_says_so(tmp_path, rows, caplog):
    """lmdb's slab has fixed slots: the same capacity holds the raw count, and the open warns
    where the room would be (kind: files)."""
    caplog.set_level("WARNING", logger="kvtier")
    tier = open_tier("lmdb", tmp_path / "s", rows, N, codec="lossless")
    try:
        assert tier.capacity_blocks == N
        assert "saves bytes written and read, not room" in caplog.text and "kind: files" in caplog.text
    finally:
        tier.close()
    caplog.clear()
    open_tier("files", tmp_path / "f", rows, N, codec="lossless").close()
    open_tier("lmdb", tmp_path / "i", rows, N, codec="int8").close()  # fixed size: slots fit it
    assert "not room" not in caplog.text

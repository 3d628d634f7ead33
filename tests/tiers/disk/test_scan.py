"""Blocks found in a store directory by their headers alone, for both disk kinds."""

from kvtier_testing import key
from kvtier_testing.store import open_tier, store

from kvtier.tiers.disk.format import HEADER_BYTES
from kvtier.tiers.disk.scan import find_blocks


def test_every_committed_block_is_found_where_its_bytes_are(kind, tmp_path, shm):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    keys = [key(i) for i in range(5)]
    try:
        assert store(tier, shm.rows, keys).ok == keys
        found = {}
        for path, offset, k in find_blocks(str(tmp_path / "s"), shm.rows.shape[1]):
            with open(path, "rb") as stream:
                stream.seek(offset + HEADER_BYTES)
                found[k] = stream.read(shm.rows.shape[1])
        assert set(found) == set(keys)
        for row, k in enumerate(keys):  # store() filled rows 0.. in key order
            assert found[k] == shm.rows[row].tobytes()
        assert list(find_blocks(str(tmp_path / "s"), shm.rows.shape[1] * 2)) == []  # other size
    finally:
        tier.close()

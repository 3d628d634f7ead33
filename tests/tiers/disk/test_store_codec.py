"""Disk tiers with a codec: restart, check, a secret, and what the stats say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from kvtier_testing import key, kv_payload
from kvtier_testing.store import flip, load, locate, open_tier, region, run

from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.format import HEADER_BYTES, decode_header

#: whole groups of every codec (bf16), not a multiple of 4096
BLOCK = 12_160


@pytest.fixture
def rows():
    made = region(32, BLOCK)
    yield made.rows
    made.close()


def put(tier, rows, keys, first_row=0):
    for row, k in enumerate(keys, start=first_row):
        rows[row] = kv_payload(k, BLOCK)
    return run(tier, keys, range(first_row, first_row + len(keys)), load=False)


def decoded(tier, k):
    block = kv_payload(k, BLOCK)
    return tier.codec.decode(tier.codec.encode(block)) if tier.codec.lossy else block


@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_a_codec_store_serves_its_blocks_after_a_restart_and_checks_healthy(kind, tmp_path, rows, codec):
    keys = [key(i) for i in range(6)]
    tier = open_tier(kind, tmp_path / "s", rows, 8, codec=codec)
    assert put(tier, rows, keys).success
    stats = tier.stats()
    assert stats["codec_block_bytes"] == len(keys) * BLOCK
    assert 0 < stats["codec_stored_bytes"] < stats["codec_block_bytes"] / 1.3  # the ratio achieved
    tier.close()
    tier = open_tier(kind, tmp_path / "s", rows, 8, codec=codec)
    assert tier.num_blocks() == len(keys)
    result = load(tier, rows, keys, first_row=16)
    assert result.success
    assert all(np.array_equal(rows[16 + i], decoded(tier, k)) for i, k in enumerate(keys))
    tier.close()
    # `kvtier check PATH` needs only the path: the manifest names the codec
    report = check_store(str(tmp_path / "s"))
    assert report.healthy and report.blocks_checked == len(keys)


def test_check_finds_a_damaged_compressed_block_and_fix_drops_only_it(kind, tmp_path, rows):
    keys = [key(i) for i in range(4)]
    tier = open_tier(kind, tmp_path / "s", rows, 8, codec="int4")
    assert put(tier, rows, keys).success
    path, offset = locate(tier, keys[1])
    with open(path, "rb") as stream:
        stream.seek(offset)
        stored = decode_header(stream.read(HEADER_BYTES)).payload_bytes
    assert stored < BLOCK / 3
    flip(path, offset + HEADER_BYTES + stored - 1)  # the last byte of what is stored
    tier.close()
    shown = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "check", str(tmp_path / "s"), "--json"],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 4  # fsck: problems left (no --fix)
    problems = json.loads(shown.stdout.splitlines()[-1])["problems"]
    assert len(problems) == 1 and "checksum" in problems[0]
    assert check_store(str(tmp_path / "s"), fix=True).fixed
    tier = open_tier(kind, tmp_path / "s", rows, 8, codec="int4")
    result = load(tier, rows, keys, first_row=16)
    assert sorted(result.ok) == sorted(k for k in keys if k != keys[1])
    tier.close()


def test_a_store_of_another_codec_is_wiped_not_read(kind, tmp_path, rows, caplog):
    keys = [key(i) for i in range(3)]
    tier = open_tier(kind, tmp_path / "s", rows, 8, codec="int8")
    assert put(tier, rows, keys).success
    tier.close()
    tier = open_tier(kind, tmp_path / "s", rows, 8)  # no codec now
    assert tier.num_blocks() == 0 and "codec=int8" in caplog.text
    assert not load(tier, rows, keys, first_row=16).ok
    tier.close()


def test_a_codec_with_a_secret_and_encryption_round_trips(kind, tmp_path, rows):
    pytest.importorskip("cryptography", reason="secrets need the cryptography package")
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    options = {"codec": "lossless", "secret_file": str(secret), "encrypt": "aes-gcm"}
    keys = [key(i) for i in range(4)]
    tier = open_tier(kind, tmp_path / "s", rows, 8, **options)
    assert put(tier, rows, keys).success
    path, offset = locate(tier, keys[0])
    with open(path, "rb") as stream:
        stream.seek(offset)
        page = stream.read(HEADER_BYTES)
        header = decode_header(page)
        stored = stream.read(header.payload_bytes)
    assert header.flags == 3 and header.version == 3 and header.payload_bytes < BLOCK
    assert tier.codec.encode(kv_payload(keys[0], BLOCK))[-64:] not in stored  # ciphertext on disk
    result = load(tier, rows, keys, first_row=16)
    assert result.success
    assert all(np.array_equal(rows[16 + i], kv_payload(k, BLOCK)) for i, k in enumerate(keys))
    assert tier.check().healthy
    tier.close()

"""Disk tiers with a secret: keyed blocks only, encryption at rest, and check with the secret."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from kvtier_testing import key, payload
from kvtier_testing.store import BLOCK, KINDS, fingerprint, holds, load, open_tier, store
from kvtier_testing.store import locate

from kvtier.errors import ConfigError
from kvtier.tiers.base import Failure
from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.blockio import aligned_buffer
from kvtier.tiers.disk.format import HEADER_BYTES, decode_header, encode_header_into

pytest.importorskip(
    "cryptography", reason="secrets need the cryptography package: pip install 'cryptography>=42'"
)

pytestmark = pytest.mark.parametrize("kind", KINDS)


@pytest.fixture
def secrets_dir(tmp_path):
    directory = tmp_path / "secrets"
    directory.mkdir()
    for name in ("a", "b"):
        path = directory / name
        path.write_bytes(os.urandom(32))
        path.chmod(0o600)
    return directory


def reopen(tier, kind, path, rows, **options):
    tier.close()
    return open_tier(kind, path, rows, 8, **options)


def refused(tier, rows, k, reason):
    """``k`` loads as a counted corrupt miss (``reason``): its job fails (a row whose load
    failed is never handed to the engine), the block is dropped, then a plain miss."""
    corrupt = tier.stats()["corrupt"]
    result = load(tier, rows, [k], first_row=40)
    assert result.failed == {k: Failure.corrupt(reason)} and result.ok == []
    assert tier.stats()["corrupt"] == corrupt + 1
    assert tier.lookup(k) is False


def test_blocks_round_trip_with_a_secret_and_carry_a_tag(kind, tmp_path, shm, secrets_dir):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=str(secrets_dir / "a"))
    keys = [key(i) for i in range(4)]
    assert store(tier, shm.rows, keys).success
    path, offset = locate(tier, keys[0])
    with open(path, "rb") as stream:
        stream.seek(offset)
        header = decode_header(stream.read(HEADER_BYTES))
    assert header.flags == 1 and header.checksum == 0 and any(header.tag)
    tier = reopen(tier, kind, tmp_path / "s", shm.rows, secret_file=str(secrets_dir / "a"))
    result = load(tier, shm.rows, keys, first_row=10)
    assert result.success and sorted(result.ok) == sorted(keys)
    assert all(holds(shm.rows, 10 + i, k) for i, k in enumerate(keys))
    assert tier.check().healthy
    tier.close()


def test_blocks_written_without_the_secret_or_under_another_are_misses(kind, tmp_path, shm, secrets_dir):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8)
    plain = [key(i) for i in range(2)]
    assert store(tier, shm.rows, plain).success
    tier = reopen(tier, kind, tmp_path / "s", shm.rows, secret_file=str(secrets_dir / "b"))
    keyed_b = [key(10 + i) for i in range(2)]
    assert store(tier, shm.rows, keyed_b, first_row=2).success
    tier = reopen(tier, kind, tmp_path / "s", shm.rows, secret_file=str(secrets_dir / "a"))
    refused(tier, shm.rows, plain[0], "unkeyed")
    refused(tier, shm.rows, keyed_b[0], "other secret")  # its header's key id is b's
    tier.close()


def test_a_keyed_store_opened_without_its_secret_is_refused_and_keeps_its_blocks(
    kind, tmp_path, shm, secrets_dir
):
    """Issue #32, item 6: without the secret every keyed block would fail its check and be
    dropped; the open is refused instead, and the blocks stay served."""
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=str(secrets_dir / "a"))
    keys = [key(i) for i in range(4)]
    assert store(tier, shm.rows, keys).success
    tier.close()
    with pytest.raises(
        ConfigError, match=r"secret_file.*keyed under a secret.*Give the tier that secret_file"
    ):
        open_tier(kind, tmp_path / "s", shm.rows, 8)
    assert check_store(str(tmp_path / "s"), secret_file=str(secrets_dir / "a")).healthy
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=str(secrets_dir / "a"))
    result = load(tier, shm.rows, keys, first_row=10)
    assert result.success and sorted(result.ok) == sorted(keys)
    assert all(holds(shm.rows, 10 + i, k) for i, k in enumerate(keys))
    tier.close()


def test_a_block_planted_from_scratch_is_refused(kind, tmp_path, shm, secrets_dir):
    """Someone who can write the store rewrites a block as a well-formed, unkeyed block with a
    correct xxh3 (what fools a tier without a secret): never served with the secret on."""
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=str(secrets_dir / "a"))
    victim = key(1)
    assert store(tier, shm.rows, [victim]).success
    forged = np.full(BLOCK, 0x41, dtype=np.uint8)
    page = aligned_buffer(HEADER_BYTES)
    encode_header_into(
        page,
        layout_digest=fingerprint().digest(),
        key=victim,
        payload_bytes=BLOCK,
        checksum=xxhash.xxh3_64_intdigest(forged),
    )
    path, offset = locate(tier, victim)
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(page[:] + forged.tobytes())
    refused(tier, shm.rows, victim, "unkeyed")
    tier.close()


def test_encryption_round_trips_and_stores_no_plaintext(kind, tmp_path, shm, secrets_dir):
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=str(secrets_dir / "a"), encrypt="aes-gcm")
    keys = [key(i) for i in range(3)]
    assert store(tier, shm.rows, keys).success
    assert all(holds(shm.rows, i, k) for i, k in enumerate(keys))  # the CPU rows stay plaintext
    on_disk = b"".join(
        Path(root, name).read_bytes() for root, _, names in os.walk(tmp_path / "s") for name in names
    )
    for k in keys:
        clear = payload(k, BLOCK).tobytes()
        assert all(clear[at : at + 64] not in on_disk for at in range(0, BLOCK - 64, 997))
    tier = reopen(tier, kind, tmp_path / "s", shm.rows, secret_file=str(secrets_dir / "a"), encrypt="aes-gcm")
    result = load(tier, shm.rows, keys, first_row=10)
    assert result.success
    assert all(holds(shm.rows, 10 + i, k) for i, k in enumerate(keys))  # byte for byte
    tier = reopen(tier, kind, tmp_path / "s", shm.rows, secret_file=str(secrets_dir / "b"), encrypt="aes-gcm")
    corrupt = tier.stats()["corrupt"]
    result = load(tier, shm.rows, [keys[0]], first_row=20)
    # a wrong key: a counted corrupt miss, told apart by the header's key id
    assert result.failed == {keys[0]: Failure.corrupt("other secret")}
    assert tier.stats()["corrupt"] == corrupt + 1 and tier.lookup(keys[0]) is False
    tier.close()


def test_check_with_the_secret(kind, tmp_path, shm, secrets_dir):
    secret = str(secrets_dir / "a")
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=secret, encrypt="aes-gcm")
    assert store(tier, shm.rows, [key(i) for i in range(3)]).success
    tier.close()
    report = check_store(str(tmp_path / "s"), secret_file=secret)
    assert report.healthy and report.blocks_checked == 3
    without = check_store(str(tmp_path / "s"))
    assert len(without.problems) == 3 and all("keyed (no secret here)" in p for p in without.problems)
    with pytest.raises(ConfigError, match="--secret-file"):
        check_store(str(tmp_path / "s"), fix=True)  # would drop sound blocks
    assert check_store(str(tmp_path / "s"), secret_file=secret).blocks_checked == 3
    with pytest.raises(ConfigError, match="0600"):
        os.chmod(secret, 0o644)
        check_store(str(tmp_path / "s"), secret_file=secret)


def test_kvtier_check_takes_the_secret_file(kind, tmp_path, shm, secrets_dir, capsys):
    from kvtier.cli.main import main

    secret = str(secrets_dir / "a")
    tier = open_tier(kind, tmp_path / "s", shm.rows, 8, secret_file=secret)
    assert store(tier, shm.rows, [key(i) for i in range(2)]).success
    tier.close()
    assert main(["check", str(tmp_path / "s"), "--secret-file", secret, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["healthy"] and record["blocks_checked"] == 2
    with open(secret, "rb") as stream:
        secret_bytes = stream.read()
    assert main(["check", str(tmp_path / "s"), "--secret-file", str(secrets_dir / "b")]) == 4
    out = capsys.readouterr()
    assert "other secret" in out.out and secret_bytes.hex() not in out.out + out.err
    assert main(["check", str(tmp_path / "s"), "--fix"]) == 8  # refused: could not check
    assert "--secret-file" in capsys.readouterr().err

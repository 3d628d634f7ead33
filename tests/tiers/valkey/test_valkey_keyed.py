"""The valkey tier with a secret, against a real server: keyed values, keyed names, encryption,
and ``kvtier check`` given the secret."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash
from kvtier_testing.valkey_tier import BLOCK_BYTES, finish, open_tier, settle
from kvtier_testing import key, payload

from kvtier.tiers.base import Failure, TierJob
from kvtier.tiers.disk.format import (
    HEADER_BYTES,
    LayoutFingerprint,
    decode_header,
    encode_header_into,
    set_tag,
)
from kvtier.tiers.valkey.check import check_valkey
from kvtier.tiers.valkey.tier import default_namespace

pytest.importorskip(
    "cryptography", reason="secrets need the cryptography package: pip install 'cryptography>=42'"
)


@pytest.fixture
def secrets_dir(tmp_path):
    for name in ("a", "b"):
        path = tmp_path / name
        path.write_bytes(os.urandom(32))
        path.chmod(0o600)
    return tmp_path


def store(tier, keys, rows, job_id=1):
    for index, k in enumerate(keys):
        rows[index] = payload(k, rows.shape[1])
    tier.submit_store(TierJob(job_id, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    return result


def load(tier, keys, job_id=2):
    tier.submit_load(TierJob(job_id, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    return result


def all_names(raw) -> list[bytes]:
    return sorted(raw.scan_iter(match=b"*"))


def rename_header(value: bytes, header_key: bytes) -> bytes:
    """``value`` with the key in its header replaced (checksum renewed): what a client who
    can read names and values can do without the secret."""
    header = decode_header(value[:HEADER_BYTES])
    page = bytearray(HEADER_BYTES)
    encode_header_into(
        page,
        layout_digest=header.layout_digest,
        key=header_key,
        payload_bytes=header.payload_bytes,
        checksum=header.checksum,
        flags=header.flags,
        salt=header.salt,
    )
    set_tag(page, header.tag)
    return bytes(page) + value[HEADER_BYTES:]


def test_keyed_values_round_trip_under_names_nobody_can_derive(valkey_server, secrets_dir):
    keys = [key(i) for i in range(6)]
    rows = np.zeros((6, BLOCK_BYTES), dtype=np.uint8)
    secret = str(secrets_dir / "a")
    writer = open_tier(valkey_server.url, rows, secret_file=secret)
    reader_rows = np.zeros((6, BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_server.url, reader_rows, secret_file=secret)
    raw = valkey_server.client()
    try:
        assert writer.namespace == reader.namespace
        assert writer.namespace != default_namespace(LayoutFingerprint.standalone(BLOCK_BYTES))
        assert store(writer, keys, rows).success
        names = all_names(raw)
        assert len(names) == 6
        public = [k.hex().encode() for k in keys] + [k[:32].hex().encode() for k in keys]
        assert not [name for name in names for p in public if p in name]  # no public hash in a name
        for name in names:
            value = raw.get(name)
            assert not any(k in value for k in keys) and not any(k[:32] in value for k in keys)
            assert decode_header(value[:HEADER_BYTES]).flags == 1
        assert settle(reader, keys) == [True] * 6
        result = load(reader, keys)
        assert result.success
        for index, k in enumerate(keys):
            assert np.array_equal(reader_rows[index], payload(k, BLOCK_BYTES))
    finally:
        writer.close()
        reader.close()


def test_planted_forged_and_foreign_values_are_counted_misses(valkey_server, secrets_dir):
    keys = [key(i) for i in range(4)]
    rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows, secret_file=str(secrets_dir / "a"))
    other_rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    other = open_tier(
        valkey_server.url, other_rows, secret_file=str(secrets_dir / "b"), namespace=tier.namespace
    )
    raw = valkey_server.client()
    try:
        assert store(tier, keys, rows).success
        assert store(other, keys, other_rows).success
        names = [tier._name(k) for k in keys]
        header_keys = [tier._header_key(k) for k in keys]
        # 0: planted from scratch: a well-formed header and payload with a correct xxh3
        forged = np.full(BLOCK_BYTES, 0x41, dtype=np.uint8)
        page = bytearray(HEADER_BYTES)
        encode_header_into(
            page,
            layout_digest=LayoutFingerprint.standalone(BLOCK_BYTES).digest(),
            key=header_keys[0],
            payload_bytes=BLOCK_BYTES,
            checksum=xxhash.xxh3_64_intdigest(forged),
        )
        raw.set(names[0], bytes(page) + forged.tobytes())
        # 1: a value of the same key written under another secret, its header made to match
        raw.set(names[1], rename_header(raw.get(other._name(keys[1])), header_keys[1]))
        # 2: a genuine value rewritten: one payload byte flipped
        altered = bytearray(raw.get(names[2]))
        altered[HEADER_BYTES + 5] ^= 1
        raw.set(names[2], bytes(altered))
    finally:
        tier.close()
        other.close()

    reader_rows = np.zeros((4, BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_server.url, reader_rows, secret_file=str(secrets_dir / "a"))
    try:
        # the header says unkeyed: refused at the read; the others fail their tag on load
        assert settle(reader, keys) == [False, True, True, True]
        result = load(reader, keys[1:])
        assert result.failed == {keys[1]: Failure.corrupt("MAC"), keys[2]: Failure.corrupt("MAC")}
        assert result.ok == [keys[3]] and np.array_equal(reader_rows[2], payload(keys[3], BLOCK_BYTES))
        assert reader.stats()["corrupt_values"] == 3
        assert [reader.lookup(k) for k in keys[:3]] == [False] * 3
    finally:
        reader.close()


def test_a_tier_without_the_secret_never_serves_keyed_values(valkey_server, secrets_dir):
    keys = [key(i) for i in range(2)]
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    tier = open_tier(valkey_server.url, rows, secret_file=str(secrets_dir / "a"), namespace="ns")
    raw = valkey_server.client()
    try:
        assert store(tier, keys, rows).success
        plain = open_tier(valkey_server.url, np.zeros((2, BLOCK_BYTES), dtype=np.uint8), namespace="ns")
        # even told the keyed name, a tier without the secret refuses the value
        raw.set(plain._name(keys[0]), raw.get(tier._name(keys[0])))
        raw.set(plain._name(keys[1]), rename_header(raw.get(tier._name(keys[1])), keys[1]))
        assert settle(plain, keys) == [False, False]
        assert plain.stats()["corrupt_values"] == 2
        plain.close()
    finally:
        tier.close()


def test_encrypted_values_round_trip_and_hold_no_plaintext(valkey_server, secrets_dir):
    keys = [key(i) for i in range(3)]
    rows = np.zeros((3, BLOCK_BYTES), dtype=np.uint8)
    secret = str(secrets_dir / "a")
    tier = open_tier(valkey_server.url, rows, secret_file=secret, encrypt="aes-gcm")
    wrong = open_tier(
        valkey_server.url,
        np.zeros((3, BLOCK_BYTES), dtype=np.uint8),
        secret_file=str(secrets_dir / "b"),
        encrypt="aes-gcm",
        namespace=tier.namespace,
    )
    raw = valkey_server.client()
    try:
        assert store(tier, keys, rows).success
        for index, k in enumerate(keys):
            assert np.array_equal(rows[index], payload(k, BLOCK_BYTES))  # the CPU row stays clear
            value = raw.get(tier._name(k))
            assert len(value) == HEADER_BYTES + BLOCK_BYTES
            assert decode_header(value[:HEADER_BYTES]).flags == 3
            clear = payload(k, BLOCK_BYTES).tobytes()
            assert all(clear[at : at + 64] not in value for at in range(0, BLOCK_BYTES - 64, 1021))
        rows[:] = 0
        tier._forget_server()  # read them back from the server, not from what it remembers
        assert settle(tier, keys) == [True] * 3
        assert load(tier, keys).success
        for index, k in enumerate(keys):
            assert np.array_equal(rows[index], payload(k, BLOCK_BYTES))  # byte for byte
        # under another key (its header made to match): a counted corrupt miss
        raw.set(wrong._name(keys[0]), rename_header(raw.get(tier._name(keys[0])), wrong._header_key(keys[0])))
        assert settle(wrong, keys[:1]) == [True]
        assert load(wrong, keys[:1]).failed == {keys[0]: Failure.corrupt("MAC")}
        assert wrong.stats()["corrupt_values"] == 1
    finally:
        tier.close()
        wrong.close()


def test_check_with_and_without_the_secret(valkey_server, secrets_dir):
    keys = [key(i) for i in range(3)]
    rows = np.zeros((3, BLOCK_BYTES), dtype=np.uint8)
    secret = str(secrets_dir / "a")
    tier = open_tier(valkey_server.url, rows, secret_file=secret, encrypt="aes-gcm")
    raw = valkey_server.client()
    try:
        assert store(tier, keys, rows).success
        assert tier.check().healthy and tier.check().blocks_checked == 3
        report = check_valkey(valkey_server.url, secret_file=secret)
        assert report.healthy and report.blocks_checked == 3
        blind = check_valkey(valkey_server.url)  # keyed values cannot be judged without it
        assert blind.healthy and [n.unverified for n in blind.namespaces] == [3]
        forged = np.zeros(BLOCK_BYTES, dtype=np.uint8)
        page = bytearray(HEADER_BYTES)
        encode_header_into(
            page,
            layout_digest=LayoutFingerprint.standalone(BLOCK_BYTES).digest(),
            key=tier._header_key(keys[0]),
            payload_bytes=BLOCK_BYTES,
            checksum=xxhash.xxh3_64_intdigest(forged),
        )
        raw.set(tier._name(keys[0]), bytes(page) + forged.tobytes())
        report = check_valkey(valkey_server.url, secret_file=secret, fix=True)
        assert report.problems == [f"{tier._name(keys[0]).decode()}: unkeyed"]
        assert raw.exists(tier._name(keys[0])) == 0
        assert check_valkey(valkey_server.url, secret_file=secret).healthy
    finally:
        tier.close()

"""The secret module: the secret file's checks, the section keys, keyed and encrypted blocks."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash

from kvtier.config import parse_tier
from kvtier.errors import ConfigError
from kvtier.tiers.disk.format import (
    FLAG_ENCRYPTED,
    FLAG_KEYED,
    HEADER_BYTES,
    decode_header,
    encode_header_into,
    verify,
)
from kvtier.tiers.secret import SECRET_MIN_BYTES, read_secret_file

DIGEST = bytes(range(16))
KEY = b"an offload key, 36 bytes long......."
NBYTES = 3 * 4096 + 100


def secret_file(directory, name="secret", size=SECRET_MIN_BYTES, mode=0o600) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as stream:
        stream.write(os.urandom(size))
    os.chmod(path, mode)
    return path


# -- the secret file ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_file_of_32_bytes_is_read(tmp_path, mode):
    path = secret_file(tmp_path, mode=mode)
    with open(path, "rb") as stream:
        assert read_secret_file(path, "tiers[1].secret_file") == stream.read()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_file_others_may_read_is_refused(tmp_path, mode):
    path = secret_file(tmp_path, mode=mode)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.secret_file.*0600.*chmod 600"):
        read_secret_file(path, "tiers[1].secret_file")


def test_a_short_file_is_refused_and_its_bytes_never_shown(tmp_path):
    path = secret_file(tmp_path, size=SECRET_MIN_BYTES - 1)
    with open(path, "rb") as stream:
        secret = stream.read()
    with pytest.raises(ConfigError, match="32 to") as caught:
        read_secret_file(path, "tiers[1].secret_file")
    assert secret.hex() not in str(caught.value) and repr(secret) not in str(caught.value)


def test_a_symlink_a_directory_and_a_missing_file_are_refused(tmp_path):
    target = secret_file(tmp_path)
    os.symlink(target, tmp_path / "link")
    for path in (tmp_path / "link", tmp_path, tmp_path / "absent"):
        with pytest.raises(ConfigError, match="secret_file"):
            read_secret_file(str(path), "tiers[1].secret_file")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    path = secret_file(tmp_path)
    os.chown(path, 54321, -1)  # any uid but ours: no account needed to own a file
    with pytest.raises(ConfigError, match="owned by this user"):
        read_secret_file(path, "tiers[1].secret_file")


# -- the section keys --------------------------------------------------------------------------


def test_the_section_keys_parse_and_encrypt_needs_a_secret(tmp_path):
    base = {"kind": "files", "name": "nvme", "capacity": "1GiB", "path": str(tmp_path)}
    tier = parse_tier({**base, "secret_file": "/etc/kvtier/secret", "encrypt": "aes-gcm"}, "tiers[1]")
    assert (tier.secret_file, tier.encrypt) == ("/etc/kvtier/secret", "aes-gcm")
    assert (parse_tier(base, "tiers[1]").secret_file, parse_tier(base, "tiers[1]").encrypt) == (None, "none")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.encrypt.*add secret_file"):
        parse_tier({**base, "encrypt": "aes-gcm"}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.encrypt.*one of none, aes-gcm"):
        parse_tier({**base, "secret_file": "/s", "encrypt": "chacha"}, "tiers[1]")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.secret_file"):
        parse_tier({**base, "secret_file": ""}, "tiers[1]")
    with pytest.raises(ConfigError, match="secret_file"):
        parse_tier({"kind": "cpu", "name": "cpu", "capacity": "1GiB", "secret_file": "/s"}, "tiers[0]")


def test_a_secret_without_the_cryptography_package_names_the_extra(tmp_path, monkeypatch):
    from kvtier.tiers import secret

    tier = parse_tier(
        {
            "kind": "files",
            "name": "nvme",
            "capacity": "1GiB",
            "path": str(tmp_path),
            "secret_file": secret_file(tmp_path),
        },
        "tiers[1]",
    )
    monkeypatch.setattr(secret, "_crypto", lambda: None)  # as where the package is not installed
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.secret_file.*pip install 'cryptography>=42'"):
        secret.tier_keys(tier, "tiers[1]")
    assert (
        secret.tier_keys(
            parse_tier(
                {"kind": "files", "name": "nvme", "capacity": "1GiB", "path": str(tmp_path)}, "tiers[1]"
            ),
            "tiers[1]",
        )
        is None
    )


# -- blocks ------------------------------------------------------------------------------------

crypto = pytest.importorskip  # the block tests need the cryptography package (the secure extra)


@pytest.fixture
def keys_of(tmp_path):
    crypto("cryptography")
    from kvtier.tiers.secret import TierKeys

    def make(name="secret", encrypt=False):
        path = secret_file(tmp_path, name) if not os.path.exists(tmp_path / name) else str(tmp_path / name)
        return TierKeys(read_secret_file(path, "secret_file"), encrypt=encrypt)

    return make


def plaintext() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)


def sealed(keys, payload):
    page = bytearray(HEADER_BYTES)
    encode_header_into(
        page,
        layout_digest=DIGEST,
        key=KEY,
        payload_bytes=NBYTES,
        checksum=0,
        flags=keys.flags,
        salt=keys.new_salt(),
    )
    stored = np.frombuffer(bytes(keys.seal(page, payload)), dtype=np.uint8).copy()
    return page, stored


def check(page, payload, keys):
    return verify(
        page, payload, HEADER_BYTES + NBYTES, key=KEY, layout_digest=DIGEST, payload_bytes=NBYTES, keys=keys
    )


def test_a_keyed_block_verifies_only_under_its_secret(keys_of):
    mine, other = keys_of("a"), keys_of("b")
    page, stored = sealed(mine, plaintext())
    header = decode_header(page)
    assert header.flags == FLAG_KEYED and header.checksum == 0 and any(header.tag)
    assert np.array_equal(stored, plaintext())  # MAC only: the payload is stored as it is
    assert check(page, stored.copy(), mine) is None
    assert check(page, stored.copy(), other) == "MAC"
    assert check(page, stored.copy(), None) == "keyed (no secret here)"
    altered = stored.copy()
    altered[NBYTES - 1] ^= 1
    assert check(page, altered, mine) == "MAC"
    # the header is covered too: another salt (checksum renewed, so only the tag can tell)
    forged = bytearray(page)
    forged[60] ^= 1
    end = struct.calcsize("<8sHHI16sQQ16s16sH") + len(KEY)
    forged[end : end + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(forged[:end])))
    assert check(forged, stored.copy(), mine) == "MAC"


def test_an_unkeyed_block_is_refused_with_a_secret_even_when_well_formed(keys_of):
    """A planted block: a correct header and xxh3, made without the secret."""
    payload = plaintext()
    page = bytearray(HEADER_BYTES)
    encode_header_into(
        page, layout_digest=DIGEST, key=KEY, payload_bytes=NBYTES, checksum=xxhash.xxh3_64_intdigest(payload)
    )
    assert check(page, payload, None) is None
    assert check(page, payload, keys_of()) == "unkeyed"


def test_a_version_1_block_is_still_read_without_a_secret(keys_of):
    payload = plaintext()
    fixed = (
        struct.pack(
            "<8sHHI16sQQH", b"KVTBLOCK", 1, 0, 0, DIGEST, NBYTES, xxhash.xxh3_64_intdigest(payload), len(KEY)
        )
        + KEY
    )
    page = bytearray(HEADER_BYTES)
    page[: len(fixed) + 8] = fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed))
    header = decode_header(page)
    assert (header.version, header.key, header.flags) == (1, KEY, 0)
    assert check(page, payload, None) is None
    assert check(page, payload, keys_of()) == "unkeyed"


def test_encryption_round_trips_byte_for_byte_and_hides_the_payload(keys_of):
    mine = keys_of("a", encrypt=True)
    page, stored = sealed(mine, plaintext())
    assert decode_header(page).flags == FLAG_KEYED | FLAG_ENCRYPTED
    clear = plaintext().tobytes()
    assert all(clear[at : at + 32] not in stored.tobytes() for at in range(0, NBYTES - 32, 512))
    row = stored.copy()
    assert check(page, row, mine) is None
    assert np.array_equal(row, plaintext())
    # a reader with the same secret but without encrypt on still reads it (the flag says how)
    row = stored.copy()
    assert check(page, row, keys_of("a")) is None and np.array_equal(row, plaintext())
    assert check(page, stored.copy(), keys_of("b", encrypt=True)) == "MAC"


def test_names_and_namespaces_are_keyed(keys_of):
    mine, other = keys_of("a"), keys_of("b")
    assert mine.name_digest(KEY) == keys_of("a").name_digest(KEY) != other.name_digest(KEY)
    assert KEY.hex() not in mine.name_digest(KEY).hex() and len(mine.name_digest(KEY)) == 16
    assert mine.namespace(DIGEST) != other.namespace(DIGEST)
    assert mine.namespace(DIGEST).startswith("kvtier:") and len(mine.namespace(DIGEST)) == 23

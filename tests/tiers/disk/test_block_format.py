"""The on-disk block format: fingerprint, header, and every way verification says no."""

import dataclasses
import json

import numpy as np
import pytest
import xxhash

from kvtier.tiers.disk.format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    LayoutFingerprint,
    decode_header,
    encode_header_into,
    on_disk_block_bytes,
    padded_payload_bytes,
    verify,
)
from kvtier.tiers.disk.manifest import (
    ManifestError,
    StoreManifest,
    read_manifest,
    write_manifest,
)
from kvtier.tiers.disk.blockio import aligned_buffer

FP = LayoutFingerprint("m", "bfloat16", 16, (4096, 8192), 0, 2, 12288)
KEY = b"k" * 32 + b"\0\0\0\1"


def block(key=KEY, fp=FP, nbytes=5000, seed=1):
    page = aligned_buffer(HEADER_BYTES)
    body = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    encode_header_into(
        page,
        layout_digest=fp.digest(),
        key=key,
        payload_bytes=nbytes,
        checksum=xxhash.xxh3_64_intdigest(body),
    )
    return page, body


def check(page, body, nread=None, key=KEY, fp=FP):
    nread = HEADER_BYTES + len(body) if nread is None else nread
    return verify(page, body, nread, key=key, layout_digest=fp.digest(), payload_bytes=len(body))


def test_sizes_round_to_pages():
    assert padded_payload_bytes(1) == 4096 and padded_payload_bytes(4096) == 4096
    assert padded_payload_bytes(4097) == 8192
    assert on_disk_block_bytes(2 << 20) == (2 << 20) + 4096


def test_every_fingerprint_field_changes_the_digest():
    seen = {FP.digest()}
    for name, value in [
        ("model", "other"),
        ("dtype", "fp8"),
        ("tokens_per_block", 32),
        ("page_bytes", (4096, 4096)),
        ("rank", 1),
        ("world_size", 4),
        ("block_bytes", 8192),
    ]:
        seen.add(dataclasses.replace(FP, **{name: value}).digest())
    assert len(seen) == 8
    assert len(FP.digest()) == 16
    assert FP.digest() == LayoutFingerprint.from_dict(json.loads(json.dumps(FP.to_dict()))).digest()


def test_standalone_fingerprint_and_validation():
    fp = LayoutFingerprint.standalone(4096)
    assert fp.model == "standalone" and fp.block_bytes == 4096 and fp.world_size == 1
    assert fp.page_bytes == (4096,)
    with pytest.raises(ValueError):
        LayoutFingerprint("m", "d", 1, (1,), rank=2, world_size=2, block_bytes=1)
    with pytest.raises(ValueError):
        LayoutFingerprint("m", "d", -1, (1,), 0, 1, 1)


def test_header_round_trip():
    page, body = block()
    header = decode_header(page)
    assert header.key == KEY and header.payload_bytes == 5000
    assert header.layout_digest == FP.digest()
    assert header.checksum == xxhash.xxh3_64_intdigest(body)
    assert check(page, body) is None


def test_header_page_is_deterministic():
    first, _ = block()
    page = aligned_buffer(HEADER_BYTES)
    page[:] = b"\xff" * HEADER_BYTES  # stale bytes of an earlier, longer header
    _, body = block()
    encode_header_into(
        page, layout_digest=FP.digest(), key=KEY, payload_bytes=5000, checksum=xxhash.xxh3_64_intdigest(body)
    )
    assert page[:] == first[:]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p, b: p.__setitem__(slice(0, 1), b"X"), "bad magic"),
        (lambda p, b: p.__setitem__(slice(8, 9), b"\x07"), "format version 7"),
        (lambda p, b: p.__setitem__(slice(60, 61), bytes([p[60] ^ 1])), "header checksum"),
        (lambda p, b: b.__setitem__(100, b[100] ^ 0x01), "checksum"),
        (lambda p, b: b.__setitem__(4999, b[4999] ^ 0x80), "checksum"),
    ],
)
def test_damage_is_named(damage, reason):
    page, body = block()
    damage(page, body)
    assert check(page, body) == reason


def test_truncation_other_layout_other_key_and_length():
    page, body = block()
    assert check(page, body, nread=HEADER_BYTES - 1) == "truncated"
    assert check(page, body, nread=HEADER_BYTES + 4999) == "truncated"
    other_fp = dataclasses.replace(FP, model="other")
    assert check(page, body, fp=other_fp) == "other layout"
    assert check(page, body, key=b"another key") == "other key"
    assert (
        verify(page, body[:4000], HEADER_BYTES + 5000, key=KEY, layout_digest=FP.digest(), payload_bytes=4000)
        == "payload length"
    )
    assert decode_header(b"\0" * 100) == "truncated"


def test_key_limits():
    page = aligned_buffer(HEADER_BYTES)
    long_key = b"x" * MAX_KEY_BYTES
    encode_header_into(page, layout_digest=FP.digest(), key=long_key, payload_bytes=1, checksum=0)
    assert decode_header(page).key == long_key
    with pytest.raises(ValueError):
        encode_header_into(page, layout_digest=FP.digest(), key=long_key + b"x", payload_bytes=1, checksum=0)


def test_manifest_round_trip_and_damage(tmp_path):
    manifest = StoreManifest.new("lmdb", FP, 1 << 30)
    write_manifest(str(tmp_path), manifest)
    back = read_manifest(str(tmp_path))
    assert back.kind == "lmdb" and back.fingerprint == FP and back.capacity_bytes == 1 << 30
    record = json.loads((tmp_path / "kvtier-store.json").read_text())
    assert record["fingerprint"]["digest"] == FP.digest().hex()
    assert read_manifest(str(tmp_path / "nothing")) is None
    record["fingerprint"]["model"] = "edited by hand"
    (tmp_path / "kvtier-store.json").write_text(json.dumps(record))
    with pytest.raises(ManifestError, match="digest"):
        read_manifest(str(tmp_path))
    (tmp_path / "kvtier-store.json").write_text("{not json")
    with pytest.raises(ManifestError, match="kvtier-store.json"):
        read_manifest(str(tmp_path))


def _vllm_like(tp: int, dtype: str = "bfloat16", name: str = "meta-llama/Llama-3.1-8B") -> dict:
    # the model string vLLM's layout_fingerprint builds: the parallel layout rides in it, the
    # worker's page bytes and the row's block bytes follow from it, rank is 0
    facts = (
        f"kv_cache_layout=NHD;groups=0:32x16;tp={tp};pp=1;pcp=1;dcp=1;replicated=0;canonical=0;shards={tp}"
    )
    return LayoutFingerprint(
        model=f"{name}|{facts}",
        dtype=dtype,
        tokens_per_block=16,
        page_bytes=(2 * 1024 * 1024 // tp,),
        rank=0,
        world_size=tp,
        block_bytes=2 * 1024 * 1024,
    ).to_dict()


def _sglang_like(tp: int, layers: int = 32) -> dict:
    from kvtier.integrations.sglang.settings import PoolFacts, ShardFacts, layout_fingerprint

    pool = PoolFacts(
        "MHATokenToKVPoolHost",
        "torch.bfloat16",
        64,
        "layer_first",
        (("layer_num", layers), ("head_num", 32 // tp), ("head_dim", 128)),
    )
    shard = ShardFacts(tp_rank=0, tp_size=tp, model_name="Qwen/Qwen3-8B")
    return layout_fingerprint(pool, shard, block_bytes=64 * 1024 // tp, parts=1, staged=False).to_dict()


def test_the_part_that_differs_sees_the_parallel_layout_engines_put_in_the_model():
    from kvtier.tiers.disk.format import differing_part

    assert differing_part(_vllm_like(2), _vllm_like(4)) == "tp"
    assert differing_part(_vllm_like(2), _vllm_like(2, dtype="fp8_e4m3")) == "layout"
    assert differing_part(_vllm_like(2), _vllm_like(4, name="Qwen/Qwen3-8B")) == "layout"
    assert differing_part(_vllm_like(2), _vllm_like(2)) == "namespace"
    assert differing_part(_sglang_like(2), _sglang_like(4)) == "tp"  # head_num follows tp
    assert differing_part(_sglang_like(2), _sglang_like(2, layers=40)) == "layout"  # another model's depth


def test_a_codec_block_records_its_codec_and_only_its_codec_reads_it():
    """Version 3: the codec's descriptor in the header; a reader of another codec (or of
    none) refuses the block before looking at its payload; blocks without one stay version 2."""
    from kvtier.codecs import make_codec

    int8 = make_codec("int8", 12288, "bfloat16", "t")
    page = aligned_buffer(HEADER_BYTES)
    body = np.random.default_rng(2).integers(0, 256, int8.max_encoded_bytes, dtype=np.uint8)
    encode_header_into(
        page,
        layout_digest=FP.digest(),
        key=KEY,
        payload_bytes=len(body),
        checksum=xxhash.xxh3_64_intdigest(body),
        codec=int8.descriptor,
    )
    header = decode_header(page)
    assert (header.version, header.codec, header.payload_bytes) == (3, int8.descriptor, len(body))
    common = {"key": KEY, "layout_digest": FP.digest(), "payload_bytes": len(body)}
    nread = HEADER_BYTES + len(body)
    assert verify(page, body, nread, codec=int8.descriptor, **common) is None
    assert verify(page, body, nread, **common) == "other codec"  # a reader without a codec
    int4 = make_codec("int4", 12288, "bfloat16", "t")
    assert verify(page, body, nread, codec=int4.descriptor, **common) == "other codec"
    assert decode_header(block()[0]).version == 2
    # a variable-length codec: the header's length up to the reader's maximum, the rest unread
    longer = np.concatenate([body, np.zeros(100, dtype=np.uint8)])
    loose = {**common, "payload_bytes": len(longer)}
    assert verify(page, longer, nread + 100, codec=int8.descriptor, exact=False, **loose) is None
    assert verify(page, longer, nread + 100, codec=int8.descriptor, **loose) == "payload length"
    assert verify(page, body[:-1], nread - 1, codec=int8.descriptor, **common) == "truncated"


def test_a_fingerprint_names_its_codec_only_when_it_has_one():
    assert "codec" not in FP.to_dict()  # the digest of every layout without a codec is unchanged
    coded = FP.with_codec("int8")
    assert coded.digest() != FP.digest() and coded.to_dict()["codec"] == "int8"
    assert LayoutFingerprint.from_dict(coded.to_dict()) == coded
    assert LayoutFingerprint.from_dict(FP.to_dict()) == FP
    from kvtier.tiers.disk.format import differing_part

    assert differing_part(coded.to_dict(), FP.to_dict()) == "codec"
    assert "codec=int8" in coded.describe()


def test_a_keyed_block_s_tag_covers_its_codec():
    """Under a secret, a codec descriptor changed in the header (its checksum renewed, as an
    attacker could) breaks the tag: nobody can relabel a block as another codec's."""
    pytest.importorskip("cryptography")
    import struct

    from kvtier.codecs import make_codec
    from kvtier.tiers.secret import TierKeys, encode_block_header

    keys = TierKeys(b"s" * 32)
    int8, fp8 = (make_codec(name, 12288, "bfloat16", "t") for name in ("int8", "fp8"))
    body = np.random.default_rng(3).integers(0, 256, int8.max_encoded_bytes, dtype=np.uint8)
    page = aligned_buffer(HEADER_BYTES)
    encode_block_header(
        page,
        layout_digest=FP.digest(),
        key=KEY,
        payload=body,
        payload_bytes=len(body),
        keys=keys,
        codec=int8.descriptor,
    )
    keys.seal(page, body)
    common = {"key": KEY, "layout_digest": FP.digest(), "payload_bytes": len(body), "keys": keys}
    assert verify(page, body, HEADER_BYTES + len(body), codec=int8.descriptor, **common) is None
    forged = bytearray(page)
    at = forged.index(int8.descriptor)
    forged[at : at + 16] = fp8.descriptor  # the same size: only the label changes
    end = at + 16 + 2 + len(KEY)
    forged[end : end + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(forged[:end])))
    assert verify(forged, body, HEADER_BYTES + len(body), codec=fp8.descriptor, **common) == "MAC"

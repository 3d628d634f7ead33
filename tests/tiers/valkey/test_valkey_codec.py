"""The valkey tier with a codec: fewer bytes sent and held, and ``kvtier check`` of its values."""

from __future__ import annotations

import numpy as np
from kvtier_testing import key, kv_payload
from kvtier_testing.valkey_tier import BLOCK_BYTES, finish, open_tier, settle

from kvtier.tiers.base import TierJob
from kvtier.tiers.disk.format import HEADER_BYTES, LayoutFingerprint
from kvtier.tiers.valkey.check import check_valkey

BF16 = LayoutFingerprint.standalone(BLOCK_BYTES, "bfloat16")


def stored(url, keys, **options):
    """A tier that stored each key's KV-like block; its stats, and the server's memory grown."""
    rows = np.stack([kv_payload(k, BLOCK_BYTES) for k in keys])
    tier = open_tier(url, rows, BF16, **options)
    client = tier._conn.client
    before = int(client.info("memory")["used_memory"])
    tier.submit_store(TierJob(1, tuple(keys), tuple(range(len(keys)))))
    (result,) = finish(tier)
    assert result.success
    grown = int(client.info("memory")["used_memory"]) - before
    stats = tier.stats()
    tier.close()
    return tier, stats, grown


def test_a_codec_sends_and_the_server_holds_fewer_bytes(valkey_server):
    keys = [key(i) for i in range(16)]
    _, plain, plain_grown = stored(valkey_server.url, keys)
    _, int8, int8_grown = stored(valkey_server.url, keys, codec="int8")
    assert plain["sent_value_bytes"] == len(keys) * (HEADER_BYTES + BLOCK_BYTES)
    assert int8["sent_value_bytes"] < len(keys) * (HEADER_BYTES + BLOCK_BYTES // 1.9)
    assert int8_grown < 0.7 * plain_grown  # the server's own count: the values take less room


def test_codec_values_load_as_promised_and_check_healthy_until_one_is_altered(valkey_server):
    keys = [key(i) for i in range(6)]
    writer, _, _ = stored(valkey_server.url, keys, codec="lossless")
    report = check_valkey(valkey_server.url, namespace=writer.namespace)  # knowing no layout
    assert report.healthy and report.blocks_checked == len(keys)
    (found,) = report.namespaces
    assert found.value_bytes < len(keys) * (HEADER_BYTES + BLOCK_BYTES)  # compressed values
    rows = np.zeros((len(keys), BLOCK_BYTES), dtype=np.uint8)
    reader = open_tier(valkey_server.url, rows, BF16, codec="lossless")
    try:
        assert settle(reader, keys) == [True] * len(keys)
        reader.submit_load(TierJob(2, tuple(keys), tuple(range(len(keys)))))
        (result,) = finish(reader)
        assert result.success
        assert all(np.array_equal(rows[i], kv_payload(k, BLOCK_BYTES)) for i, k in enumerate(keys))
        client = reader._conn.client
        value = bytearray(client.get(reader._name(keys[2])))
        value[-1] ^= 1  # the last byte of a compressed payload
        client.set(reader._name(keys[2]), bytes(value))
        assert not reader.check().healthy
    finally:
        reader.close()
    report = check_valkey(valkey_server.url, namespace=writer.namespace, fix=True)
    assert [problem.split(": ")[-1] for problem in report.problems] == ["checksum"]
    assert check_valkey(valkey_server.url, namespace=writer.namespace).healthy

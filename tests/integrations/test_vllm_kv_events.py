"""vLLM 0.33's own KV events, on the wire and as objects, read by kvtier's router without vLLM's types."""

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
pytestmark = pytest.mark.vllm

from kvtier.routing import BlockEvent, PrefixRouter, batch_events  # noqa: E402

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


def stored(hashes, parent, medium, **extra):
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **extra,
    )


def vllm_batch():
    return kv_events.KVEventBatch(
        ts=1.0,
        events=[
            stored([H1, H2], None, kv_events.MEDIUM_GPU),
            stored([H3], H2, kv_events.MEDIUM_CPU, group_idx=0),
            kv_events.BlockRemoved(block_hashes=[H1], medium=kv_events.MEDIUM_GPU),
            kv_events.AllBlocksCleared(),
        ],
    )


EXPECTED = [
    BlockEvent("stored", "GPU", [H1, H2]),
    BlockEvent("stored", "CPU", [H3]),
    BlockEvent("removed", "GPU", [H1]),
    BlockEvent("cleared", "GPU"),
]


def test_a_batch_off_the_wire_decoded_without_vllms_types():
    # what vLLM's ZMQ publisher sends as the payload frame, decoded as a router without vLLM would
    payload = msgspec.msgpack.Encoder().encode(vllm_batch())
    assert list(batch_events(msgspec.msgpack.decode(payload))) == EXPECTED


def test_vllms_event_objects_read_as_they_are():
    assert list(batch_events(vllm_batch())) == EXPECTED


def test_a_router_fed_vllms_events_routes_to_the_engine_holding_the_prefix():
    router = PrefixRouter(2)
    batch = vllm_batch()
    batch.events = batch.events[:2]  # engine 1 holds H1, H2 on its GPU and H3 on its CPU tier
    router.feed(1, batch_events(msgspec.msgpack.decode(msgspec.msgpack.Encoder().encode(batch))))
    assert router.index is not None and router.index.score([H1, H2, H3]) == [0.0, 2.8]
    assert router.route([H1, H2, H3], now_s=0.0) == 1

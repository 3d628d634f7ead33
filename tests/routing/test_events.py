"""KV events in each shape a router meets them: vLLM's (decoded msgpack, arrays, objects) and kvtier's."""

from dataclasses import dataclass

import pytest

from kvtier.base import OffloadingEvent, make_offload_key
from kvtier.routing import BlockEvent, batch_events, block_events

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


def test_a_vllm_batch_as_msgpack_decodes_it():
    # vLLM 0.33's KVEventBatch through msgspec's encoder, read back by a plain msgpack
    # decoder: the batch an array, each event a map tagged by "type", defaults left out
    batch = [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [H1, H2],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    assert list(batch_events(batch)) == [
        BlockEvent("stored", "GPU", [H1, H2]),
        BlockEvent("removed", "CPU", [H1]),
        BlockEvent("cleared", "GPU"),
    ]


def test_array_events_of_older_releases_and_a_missing_medium_are_the_gpus():
    stored = ["BlockStored", [7, 8], None, [1, 2], 16, None]  # no medium field: the GPU cache
    removed = ["BlockRemoved", [8], "STORAGE"]
    assert list(block_events(stored)) == [BlockEvent("stored", "GPU", [7, 8])]
    assert list(block_events(removed)) == [BlockEvent("removed", "STORAGE", [8])]
    assert list(batch_events({"ts": 0.0, "events": [stored]})) == [BlockEvent("stored", "GPU", [7, 8])]


def test_vllm_event_objects_by_their_class_names():
    @dataclass
    class BlockStored:  # the fields vLLM's struct carries, by name
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object
        medium: str
        group_idx: int | None = None

    @dataclass
    class Batch:
        ts: float
        events: list

    event = BlockStored([H3], None, [], 16, None, "CPU")
    assert list(batch_events(Batch(0.0, [event]))) == [BlockEvent("stored", "CPU", [H3])]


def test_other_kv_groups_and_unknown_types_are_skipped():
    other_group = {"type": "BlockStored", "block_hashes": [H1], "medium": "GPU", "group_idx": 1}
    newer = {"type": "BlockPinned", "block_hashes": [H1]}
    assert list(block_events(other_group)) == []
    assert list(block_events(other_group, group=1)) == [BlockEvent("stored", "GPU", [H1])]
    assert list(block_events(newer)) == []


def test_kvtier_events_give_each_keys_block_hash_and_skip_retractions():
    keys = [make_offload_key(H1, 0), make_offload_key(H2, 0), make_offload_key(H3, 1)]
    assert list(block_events(OffloadingEvent(keys, 4096, "LMDB", False))) == [
        BlockEvent("stored", "LMDB", [H1, H2])
    ]
    assert list(block_events(OffloadingEvent(keys, 4096, "CPU", True))) == [
        BlockEvent("removed", "CPU", [H1, H2])
    ]
    # a store that failed before any reader was told of it: nothing to undo
    assert list(block_events(OffloadingEvent(keys, 4096, "CPU", True, metadata_only=True))) == []


@pytest.mark.parametrize(
    ("event", "named"),
    [
        ({"type": "BlockStored", "medium": "GPU"}, "block_hashes"),
        ({"type": "BlockRemoved", "block_hashes": "abc", "medium": "GPU"}, "block_hashes"),
        ({"type": "BlockRemoved", "block_hashes": [1], "medium": 3}, "medium"),
        (42, "not a KV event"),
    ],
)
def test_a_malformed_event_names_what_is_wrong(event, named):
    with pytest.raises(ValueError, match=named):
        list(block_events(event))


def test_a_batch_without_events_is_refused():
    with pytest.raises(ValueError, match=r"\[ts, events"):
        list(batch_events(3.0))

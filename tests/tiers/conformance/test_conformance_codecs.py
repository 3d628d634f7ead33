"""Codecs through every lower-tier kind that takes one (``codec:`` in its section).

Blocks are bf16 KV-like values (the stack's layout says bfloat16, so lossy codecs may run);
a block served is compared with what its codec promises: the block byte for byte (lossless),
its own encode -> decode (lossy). A kind whose section has no ``codec`` key is skipped,
naming it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kvtier_testing.conformance.conformance_stack import Stack, keys

from kvtier.config import TIER_KINDS
from kvtier.tiers.disk.format import HEADER_BYTES, on_disk_block_bytes

CODECS = ("lossless", "int8", "fp8", "int4")
#: whole groups of every codec (64 bf16 values), and not a multiple of 4096: disk tiers move
#: padded rows, and encoded blocks end inside a page
BLOCK = 12_160


def codec_stack(harness, stacks: list[Stack], scenario: str, codec: str, **sizes) -> Stack:
    section = TIER_KINDS.resolve(harness.kind, field="kind") if harness.kind in TIER_KINDS else None
    if section is None or "codec" not in {f.name for f in dataclasses.fields(section)}:
        harness.cannot("a codec", f"kind {harness.kind}'s section has no codec key")
    harness.place(scenario)
    stack = Stack(harness, codec=codec, block_bytes=BLOCK, **sizes)
    stacks.append(stack)
    return stack


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_as_it_promises(harness, stacks, codec):
    stack = codec_stack(harness, stacks, "codec round trip", codec)
    blocks = keys(0, 16)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    stack.forget()
    served, wrong = stack.serve(blocks)  # each compared with stack.expected: see the module docstring
    assert served == blocks and wrong == 0
    changed = sum(not np.array_equal(stack.expected(k), stack.make(k, BLOCK)) for k in blocks)
    assert changed == (len(blocks) if codec != "lossless" else 0)  # lossy is lossy, lossless is not
    stats = stack.stats()
    assert stats["far.promotions"] == len(blocks) and stats["far.corrupt_blocks"] == 0
    # the medium was given fewer bytes than the raw blocks (a value counts its header too)
    name = harness.counters["stored_bytes"]
    header = HEADER_BYTES if name == "sent_value_bytes" else 0
    stored = stack.far(name)
    assert stored is None or 0 < stored < len(blocks) * (0.9 * BLOCK + header)


@pytest.mark.parametrize("codec", CODECS)
def test_a_flipped_byte_in_a_stored_block_is_a_counted_miss_before_any_decode(harness, stacks, codec):
    stack = codec_stack(harness, stacks, "codec corrupt", codec)
    blocks = keys(0, 8)
    stack.store(blocks)
    victim = harness.victim(stack.tier, blocks)
    harness.corrupt(stack.tier, [victim])
    stack.forget()
    served, wrong = stack.serve(blocks)
    assert served == [k for k in blocks if k != victim] and wrong == 0
    assert stack.stats()["far.corrupt_blocks"] == 1
    # the checksum over the stored bytes caught it: the decoder never saw it
    assert stack.far(harness.checks["corrupt"]) == 1
    assert stack.far("corrupt_codec") == 0


def test_a_reader_with_another_codec_never_decodes_a_block(harness, stacks):
    stack = codec_stack(harness, stacks, "codec mismatch", "int8")
    blocks = keys(0, 8)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks
    other = stack.reopen(codec="int4")  # the same path or namespace, another codec
    stacks.append(other)
    served, wrong = other.serve(blocks)
    assert served == [] and wrong == 0
    stats = other.stats()
    assert stats["far.promotions"] == 0
    # a disk store of another codec is wiped at open; a value of another codec is read and
    # refused by its header: either way a foreign miss, naming the codec
    assert stats["foreign_codec"] >= 1, {k: v for k, v in stats.items() if v and "miss" in k}
    assert stack.far("corrupt_checksum") == 0


def test_a_codec_tier_holds_more_blocks_in_the_same_bytes(harness, stacks):
    lower = 8
    raw = codec_stack(harness, stacks, "codec capacity", "lossless", lower_blocks=lower)
    if raw.tier.capacity_blocks == 0 or getattr(raw.tier, "remote", False):
        harness.cannot("capacity in bytes", "its server's memory limit bounds it, not the tier")
    section = harness.section(lower, BLOCK)
    assert raw.tier.capacity_blocks == section["capacity"] // on_disk_block_bytes(BLOCK) == lower
    raw.shutdown()
    stack = Stack(harness, codec="int4", block_bytes=BLOCK, lower_blocks=lower)  # the same bytes
    stacks.append(stack)
    assert stack.tier.capacity_blocks >= 2 * lower  # int4: a 4 KiB page of payload, not 3
    blocks = keys(0, 2 * lower)
    stack.store(blocks)
    assert stack.saved(blocks) == blocks  # none evicted: room for all in the bytes of 8 raw blocks
    stack.forget()
    served, wrong = stack.serve(blocks)
    assert served == blocks and wrong == 0
    assert stack.stats()["far.blocks"] == len(blocks)

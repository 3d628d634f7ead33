"""The cause sketch's memory and error rate, and each cause through a manager over real tiers."""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
from kvtier_testing import key, store_blocks
from kvtier_testing.store import flip, locate

import kvtier
from kvtier.base import LoadTiers, ReqContext
from kvtier.manager.causes import (
    CAUSES,
    EVICTED,
    FAILED,
    FOREIGN,
    MAX_STACK_KEYS,
    MIN_STACK_KEYS,
    REFUSED,
    STORED,
    _PROBE_KEYS,
    CauseSketch,
    MissCauses,
    key_hashes,
    stack_keys,
)
from kvtier.tiers.cpu.region import row_stride_for
from kvtier.tiers.disk.format import LayoutFingerprint

BLOCK = 8192


def random_keys(rng: random.Random, count: int) -> list[bytes]:
    return [rng.randbytes(36) for _ in range(count)]


class TestSketch:
    @pytest.mark.parametrize("keys", [4, 5, 1000, 1_000_000])
    def test_memory_is_at_most_16_bytes_a_key(self, keys):
        sketch = CauseSketch(keys)
        assert sketch.keys >= keys
        assert sketch.nbytes <= 16 * keys
        # a 32-bit word a slot (tag and record), 1 cursor byte a bucket of 4; 1.25 slots a key
        slots = -(-(keys * 5 // 4) // 4) * 4
        assert sketch.nbytes == slots * 4 + slots // 4

    def test_remembers_what_fits_exactly(self):
        rng = random.Random(1)
        sketch = CauseSketch(4096)
        stored = random_keys(rng, 1000)  # a quarter full: two buckets of 4 a key never both overflow
        for i, k in enumerate(stored):
            sketch.put((k,), EVICTED, i % 7)
        assert sketch.forgotten == 0
        assert [sketch.get(k) for k in stored] == [EVICTED << 5 | i % 7 for i in range(len(stored))]

    @pytest.mark.parametrize(("tag_bits", "seed"), [(8, 1), (10, 2), (12, 3)])
    def test_observed_false_match_rate_is_within_the_stated_one(self, tag_bits, seed):
        """A full table, then keys it never saw: the share taken for remembered ones is the
        stated rate (a binomial count; the bound allows 4 standard deviations). At 8 tag bits
        the stated rate must count tag 1's double weight (tag 0 is stored as 1): without it,
        some hash seeds observe 4.9 standard deviations above it."""
        rng = random.Random(seed)
        sketch = CauseSketch(8192, tag_bits=tag_bits)
        sketch.put(random_keys(rng, 3 * sketch.keys), STORED, 1)  # every slot taken
        trials = 200_000
        wrong = int(np.count_nonzero(sketch.records(random_keys(rng, trials))))
        rate = sketch.error_rate
        spread = 4 * (rate * (1 - rate) / trials) ** 0.5
        assert wrong / trials <= rate + spread
        assert wrong / trials >= rate - spread  # the bound is tight, not a loose ceiling

    def test_the_default_rate_is_stated_and_small(self):
        sketch = CauseSketch(1000)
        assert sketch.error_rate == pytest.approx(8 * 2.0**-24, rel=1e-5)

    def test_at_its_size_it_forgets_few_and_reports_how_many(self):
        rng = random.Random(5)
        sketch = CauseSketch(1 << 14)
        keys = random_keys(rng, sketch.keys)
        sketch.put(keys, EVICTED, 0)
        remembered = sum(1 for k in keys if sketch.get(k))
        assert remembered == len(keys) - sketch.forgotten  # each forgotten key, counted once
        assert sketch.forgotten <= 0.03 * len(keys)  # 1.4% measured (docs/design/miss-causes.md)

    def test_beyond_its_size_the_oldest_are_forgotten(self):
        rng = random.Random(4)
        sketch = CauseSketch(64)
        keys = random_keys(rng, 1000)
        sketch.put(keys, EVICTED, 0)
        slots = sketch._slots.size
        assert sketch.forgotten == 1000 - slots
        assert sum(1 for k in keys[-64:] if sketch.get(k)) > sum(1 for k in keys[:64] if sketch.get(k))

    def test_a_key_hashes_the_same_in_any_batch_and_by_all_of_its_bytes(self):
        """Keys a packed row could confuse (a trailing zero byte, one past the row's 47 bytes,
        keys that are not bytes) hash apart, and each the same alone as in any batch."""
        keys = [b"", b"ab", b"ab\0", b"x" * 46, b"x" * 47, b"x" * 48, b"x" * 99 + b"y", b"x" * 99 + b"z"]
        keys += ["ab", (1, 2), random.Random(7).randbytes(36)]
        together = key_hashes(keys).tolist()
        assert len(set(together)) == len(keys)
        assert [key_hashes([key])[0] for key in keys] == together
        assert key_hashes(keys[::-1]).tolist() == together[::-1]
        assert key_hashes(keys[:4]).tolist() == together[:4]  # a batch of bytes only: one pack

    @pytest.mark.parametrize(("keys", "tag_bits"), [(4, 3), (1000, 4), (50_000, 24)])
    def test_a_probe_reads_the_first_matching_slot_of_the_two_buckets(self, keys, tag_bits):
        """The vectorised probe against a scan of each key's eight slots in order: with few
        tag bits many keys match several slots, and the first one's record is the answer; a
        second bucket is never the first, whatever the table's size (two buckets at 4 keys)."""
        rng = random.Random(keys)
        sketch = CauseSketch(keys, tag_bits=tag_bits)
        stored = random_keys(rng, 2 * keys)
        records = [rng.randint(STORED, FOREIGN) << 5 | rng.randint(0, 30) for _ in stored]
        sketch.put_records(stored, np.array(records, dtype=np.uint8))
        probed = stored + random_keys(rng, 2 * keys)
        tags, first, second = sketch._place(key_hashes(probed))
        assert not (first == second).any() and max(first.max(), second.max()) < len(sketch._table)
        scanned, ambiguous = [], 0
        for tag, one, two in zip(tags.tolist(), first.tolist(), second.tolist()):
            slots = sketch._table[one].tolist() + sketch._table[two].tolist()
            matching = [slot & 0xFF for slot in slots if slot >> 8 == tag]
            scanned.append(matching[0] if matching else 0)
            ambiguous += len(set(matching)) > 1
        assert sketch.records(probed).tolist() == scanned
        assert any(scanned)
        if keys == 1000:  # 4 tag bits: keys in different buckets share tags, and a probe sees both
            assert ambiguous > 0

    def test_a_refusal_outlasts_the_eviction_that_follows(self):
        sketch = CauseSketch(16)
        k = key(1)
        sketch.put((k,), REFUSED, 1)
        sketch.put((k,), EVICTED, 0)
        assert sketch.get(k) == REFUSED << 5 | 1
        sketch.put((k,), STORED, 1)  # admitted later
        sketch.put((k,), EVICTED, 0)  # the CPU tier lets it go: the lower tier still has it
        assert sketch.get(k) == STORED << 5 | 1
        sketch.put((k,), EVICTED, 1)
        assert sketch.get(k) == EVICTED << 5 | 1
        sketch.put((k,), FAILED, 2)
        assert sketch.get(k) == FAILED << 5 | 2

    def test_a_batch_gives_what_one_key_at_a_time_gives(self):
        """Keys named several times in one batch, with every kind of event: the table ends as
        a dict that applies the same events in order says (a table large enough that nothing
        is forgotten)."""
        rng = random.Random(7)
        universe = random_keys(rng, 3000)
        sketch = CauseSketch(200_000)
        model: dict[bytes, int] = {}
        for _ in range(100):
            batch = [rng.choice(universe) for _ in range(rng.randint(1, 400))]
            records = [rng.randint(STORED, FOREIGN) << 5 | rng.randint(0, 3) for _ in batch]
            sketch.put_records(batch, np.array(records, dtype=np.uint8))
            for k, record in zip(batch, records):
                if k in model:  # the precedence, one event at a time
                    merged = sketch_merge(model[k], record)
                    model[k] = merged
                else:
                    model[k] = record
        assert sketch.forgotten == 0
        assert sketch.records(universe).tolist() == [model.get(k, 0) for k in universe]


def sketch_merge(old: int, new: int) -> int:
    """The precedence of docs/design/miss-causes.md, one key at a time (what the table's
    batched merge must agree with)."""
    old_event, event = old >> 5, new >> 5
    elsewhere = old_event == STORED and old & 31 != new & 31
    if event == EVICTED and (old_event >= REFUSED or elsewhere):
        return old
    if event in (REFUSED, FAILED) and elsewhere:
        return old
    return new


def cpu_section(blocks: int) -> dict:
    return {"name": "cpu", "kind": "cpu", "capacity": blocks * row_stride_for(BLOCK), "pin_memory": "off"}


def assert_causes_sum(stats: dict) -> None:
    assert sum(stats[f"miss_{cause}"] for cause in CAUSES) == stats["misses"]


def test_single_tier_new_then_evicted_exactly():
    manager = kvtier.build_manager({"tiers": [cpu_section(8)]}, BLOCK)
    ctx = ReqContext("r")
    try:
        first = [key(i) for i in range(8)]
        assert [manager.lookup(k, ctx) for k in first] == [False] * 8
        store_blocks(manager, first, ctx)
        store_blocks(manager, [key(i) for i in range(100, 105)], ctx)  # evicts 5 of the first
        answers = [manager.lookup(k, ctx) for k in first]
        stats = manager.stats()
        assert answers.count(False) == 5
        assert stats["miss_new"] == 8 and stats["miss_evicted"] == 5 and stats["cpu.miss_evicted"] == 5
        assert stats["misses"] == 13
        assert_causes_sum(stats)
        assert stats["sketch_bytes"] <= 16 * stats["sketch_keys"]
        assert stats["sketch_error_rate"] > 0
    finally:
        manager.shutdown()


def test_off_means_no_sketch_and_no_cause_counters():
    manager = kvtier.build_manager({"tiers": [cpu_section(8)], "miss_causes": "off"}, BLOCK)
    try:
        assert manager.lookup(key(1), ReqContext("r")) is False
        assert manager.miss_causes is None
        assert not any(name.startswith(("miss_", "sketch_")) for name in manager.stats())
    finally:
        manager.shutdown()


def test_left_out_the_sketch_is_sized_from_the_stack(tmp_path):
    """A CPU tier alone remembers as many keys as it holds blocks; a lower tier adds twice
    its blocks; both within the bounds (the fixed million keys were 131 bytes a block of a
    50,000-block tier)."""
    manager = kvtier.build_manager({"tiers": [cpu_section(6000)]}, BLOCK)
    try:
        assert manager.stats()["sketch_keys"] == 6000
    finally:
        manager.shutdown()
    manager = disk_stack(tmp_path, cpu_blocks=16, disk_blocks=3000)
    try:
        assert manager.stats()["sketch_keys"] == stack_keys(16, 3000) == 16 + 2 * 3000
    finally:
        manager.shutdown()
    assert stack_keys(8, 0) == MIN_STACK_KEYS and stack_keys(10**9, 10**9) == MAX_STACK_KEYS


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_default_config_keeps_at_most_200_bytes_a_block(policy, tmp_path):
    """What tracemalloc sees a default-config manager (miss causes on) allocate for 50,000
    blocks, as `kvtier bench manager` measures it: issue #32's budget."""
    from kvtier.bench.manager import kvtier_subject, make_keys, metadata_bytes

    subject = kvtier_subject(str(tmp_path))
    keys = make_keys(50_000)
    metadata_bytes(subject, policy, 1000, keys, False)  # imports and first allocations, not counted
    assert metadata_bytes(subject, policy, 50_000, keys, False) <= 200


def test_stats_read_from_another_thread_meanwhile_count_every_miss_once():
    """A metrics scrape applies the log on its own thread while the scheduler keeps noting
    misses and evictions: every miss is counted once, under the cause it had."""
    import threading

    manager = kvtier.build_manager({"tiers": [cpu_section(64)]}, BLOCK)
    ctx = ReqContext("r")
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            manager.stats()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for round_ in range(20):
            fresh = [key(1000 * round_ + i) for i in range(64)]
            assert [manager.lookup(k, ctx) for k in fresh] == [False] * 64  # new
            store_blocks(manager, fresh, ctx)  # evicts the last round's
            manager.on_schedule_end()
        gone = [key(1000 * round_ + i) for round_ in range(19) for i in range(64)]
        assert not any(manager.lookup(k, ctx) for k in gone)  # evicted
    finally:
        stop.set()
        scraper.join()
    stats = manager.stats()
    manager.shutdown()
    assert stats["miss_new"] == 20 * 64 and stats["miss_evicted"] == 19 * 64
    assert_causes_sum(stats)


def test_a_log_longer_than_a_probe_is_decided_in_order_across_its_batches():
    """Misses hashed straight from the log, a probe's batch at a time, with news between them
    at a point no batch boundary falls on: each miss is counted under what the sketch held
    when it was noted (a direct probe of the same keys says what), and the keys decided new
    come back in the order they missed."""
    rng = random.Random(11)
    causes = MissCauses(1 << 16, ["cpu", "disk"])
    causes.collect_new = True
    keys = random_keys(rng, 3 * _PROBE_KEYS + 123)
    half = len(keys) // 2
    assert half % _PROBE_KEYS
    evicted = keys[::3]
    causes.missed.extend(keys[:half])
    causes.remember(evicted, EVICTED, 1)
    causes.missed.extend(keys[half:])
    totals = causes.totals()  # the log applied
    assert not causes.missed and causes.sketch.forgotten == 0
    later = causes.sketch.records(keys[half:]).tolist()
    assert set(later) <= {0, EVICTED << 5 | 1}
    found = sum(map(bool, later))
    assert found >= len(set(evicted) & set(keys[half:]))  # a key remembered is always found
    assert totals["evicted"] == causes.per_tier[1]["evicted"] == found
    assert totals["new"] == len(keys) - found
    assert causes.take_new() == keys[:half] + [k for k, record in zip(keys[half:], later) if not record]


def test_configured_size_is_the_sketch_size():
    manager = kvtier.build_manager({"tiers": [cpu_section(8)], "miss_causes": {"keys": 4096}}, BLOCK)
    try:
        stats = manager.stats()
        assert stats["sketch_keys"] == 4096 and stats["sketch_bytes"] == 5120 * 4 + 1280
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"keys": 0}, "miss_causes.keys"),
        ({"keys": 3}, "miss_causes.keys"),
        ({"size": 3}, "miss_causes.size"),
        ("on", "miss_causes"),
    ],
)
def test_bad_miss_causes_settings_name_the_field(section, field):
    with pytest.raises(kvtier.ConfigError) as caught:
        kvtier.load_config({"tiers": [cpu_section(8)], "miss_causes": section})
    assert caught.value.field == field


def disk_stack(tmp_path, cpu_blocks=16, disk_blocks=64, fingerprint=None, causes=None, **disk):
    from kvtier.tiers.disk.format import on_disk_block_bytes

    config = {
        "tiers": [
            cpu_section(cpu_blocks),
            {
                "name": "disk",
                "kind": "lmdb",
                "path": str(tmp_path / "store"),
                "capacity": disk_blocks * on_disk_block_bytes(BLOCK),
                "fsync": "none",
                **disk,
            },
        ],
        "cascade": {"write_policy": "write_through"},
    }
    if causes is not None:
        config["miss_causes"] = causes
    return kvtier.build_manager(config, BLOCK, fingerprint=fingerprint)


def store_and_close(manager, keys, ctx):
    """Store ``keys`` through ``manager``, save them below and close it."""
    try:
        store_blocks(manager, keys, ctx)
        manager.on_schedule_end()
        manager.flush()
    finally:
        manager.shutdown()


def settle(manager, keys, ctx):
    """Look ``keys`` up once each as an engine does (stepping while any is None); answers."""
    for _ in range(200):
        answers = [manager.lookup(k, ctx) for k in keys]
        if None not in answers:
            return answers
        manager.on_schedule_end()
        for tier in manager.tiers:
            tier.drain_jobs()
    raise AssertionError("lookups never settled")


def fill_store(tmp_path, kind, blocks):
    """Store ``blocks`` in a ``kind`` store under the standalone layout and shut down; the
    CPU rows' stride."""
    manager = disk_stack(tmp_path, kind=kind, fingerprint=LayoutFingerprint.standalone(BLOCK))
    try:
        store_blocks(manager, blocks, ReqContext("r"))
        manager.on_schedule_end()
        manager.flush()
        assert all(manager.tiers[0].lookup(k) is True for k in blocks)
        return manager._backend.rows.shape[1]
    finally:
        manager.shutdown()


def store_then_reopen(tmp_path, kind, blocks, change, causes=None):
    """:func:`fill_store`, then open the store again under the standalone layout with
    ``change`` (which wipes it)."""
    fill_store(tmp_path, kind, blocks)
    changed = dataclasses.replace(LayoutFingerprint.standalone(BLOCK), **change)
    return disk_stack(tmp_path, kind=kind, fingerprint=changed, causes=causes)


@pytest.mark.parametrize("kind", ["lmdb", "files"])
@pytest.mark.parametrize(
    "change, part", [({"rank": 1, "world_size": 2}, "tp"), ({"dtype": "float16"}, "layout")]
)
def test_a_store_wiped_for_another_layout_names_the_part_in_its_misses(tmp_path, kind, change, part):
    blocks = [key(i) for i in range(6)]
    manager = store_then_reopen(tmp_path, kind, blocks, change)
    ctx = ReqContext("r")
    try:
        assert all(manager.tiers[0].lookup(k) is False for k in blocks)  # wiped, not served
        assert settle(manager, [*blocks, key(99)], ctx) == [False] * 7
        stats = manager.stats()
        assert stats["miss_foreign"] == 6 and stats[f"foreign_{part}"] == 6
        assert stats["miss_new"] == 1  # never stored anywhere
        assert_causes_sum(stats)
        assert manager.tiers[0].foreign_stored() is None  # handed to the stack once
    finally:
        manager.shutdown()


def test_a_wiped_store_with_miss_causes_off_lets_the_keys_go(tmp_path):
    blocks = [key(i) for i in range(4)]
    manager = store_then_reopen(tmp_path, "lmdb", blocks, {"dtype": "float16"}, causes="off")
    try:
        assert manager.tiers[0].foreign_stored() is None
        assert settle(manager, blocks, ReqContext("r")) == [False] * 4
        assert "miss_foreign" not in manager.stats()
    finally:
        manager.shutdown()


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_a_store_lists_its_keys_up_to_a_limit_without_opening(tmp_path, kind):
    from kvtier.tiers.disk import get_store_class

    blocks = [key(i) for i in range(10)]
    fill_store(tmp_path, kind, blocks)
    cls = get_store_class(kind)
    directory = str(tmp_path / "store")
    if kind == "files":  # a writer's temp file, or a name that is no key, is no block
        subdir = next(p for p in (tmp_path / "store" / "blocks").iterdir() if p.is_dir())
        (subdir / f".{key(50).hex()}.1.2.tmp").write_bytes(b"")
        (subdir / "not-hex.kvb").write_bytes(b"")
    assert sorted(cls.stored_keys(directory, 100)) == sorted(blocks)
    assert len(cls.stored_keys(directory, 3)) == 3


@pytest.mark.parametrize("asked", [0, 3])
def test_a_wiped_store_lists_only_the_keys_its_opener_asks_for(tmp_path, asked):
    # vLLM's and SGLang's tier paths count no causes and ask for none: their opens list nothing
    from kvtier.config import parse_tier

    blocks = [key(i) for i in range(6)]
    stride = fill_store(tmp_path, "lmdb", blocks)
    section = parse_tier(
        {"name": "disk", "kind": "lmdb", "path": str(tmp_path / "store"), "capacity": "4MiB"},
        "tiers[1]",
    )
    changed = dataclasses.replace(LayoutFingerprint.standalone(BLOCK), dtype="float16")
    rows = np.zeros((8, stride), dtype=np.uint8)  # rows of its own: the stack's are gone
    tier = section.open_lower(rows, changed, field="tiers[1]", wiped_keys=asked)
    try:
        part, keys = tier.foreign_stored()
        assert part == "layout" and len(keys) == asked and set(keys) <= set(blocks)
    finally:
        tier.close()


def test_a_damaged_index_is_wiped_without_listing_it(tmp_path):
    # LMDB maps data.mdb: a truncated one must not be listed (SIGBUS), only wiped as before
    blocks = [key(i) for i in range(4)]
    fill_store(tmp_path, "lmdb", blocks)
    data = tmp_path / "store" / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    changed = dataclasses.replace(LayoutFingerprint.standalone(BLOCK), dtype="float16")
    manager = disk_stack(tmp_path, fingerprint=changed)
    try:
        assert settle(manager, blocks, ReqContext("r")) == [False] * 4
        stats = manager.stats()
        assert stats["miss_new"] == 4 and stats["miss_foreign"] == 0  # nothing could be listed
    finally:
        manager.shutdown()


def test_refused_by_admission_then_evicted_is_refused(tmp_path):
    manager = disk_stack(tmp_path, admit="reuse", min_reuse=2)
    ctx = ReqContext("r")
    try:
        blocks = [key(i) for i in range(8)]
        store_blocks(manager, blocks, ctx)  # seen once: the disk's admission refuses them
        manager.on_schedule_end()
        manager.flush()
        manager.reset_cache()
        assert settle(manager, blocks, ctx) == [False] * 8
        stats = manager.stats()
        assert stats["miss_refused"] == 8 and stats["disk.miss_refused"] == 8
        assert stats["disk.refused_blocks"] == 8
        assert_causes_sum(stats)
    finally:
        manager.shutdown()


def test_evicted_by_the_lower_tier_names_it(tmp_path):
    manager = disk_stack(tmp_path, cpu_blocks=8, disk_blocks=8)
    ctx = ReqContext("r")
    try:
        blocks = [key(i) for i in range(16)]
        for first in range(0, 16, 4):
            store_blocks(manager, blocks[first : first + 4], ctx)
            manager.on_schedule_end()
            manager.flush()
        manager.on_schedule_end()
        manager.reset_cache()
        gone = [k for k in blocks if manager.tiers[0].lookup(k) is not True]
        assert len(gone) == 8
        assert settle(manager, gone, ctx) == [False] * 8
        stats = manager.stats()
        assert (
            stats["miss_evicted"] == 8 and stats["disk.miss_evicted"] == 8 and stats["cpu.miss_evicted"] == 0
        )
        assert_causes_sum(stats)
    finally:
        manager.shutdown()


def test_a_request_filtered_off_the_tier_that_holds_it(tmp_path):
    manager = disk_stack(tmp_path)
    ctx = ReqContext("r")
    try:
        blocks = [key(i) for i in range(6)]
        store_blocks(manager, blocks, ctx)
        manager.on_schedule_end()
        manager.flush()
        manager.reset_cache()
        limited = ReqContext("limited")
        limited.set_state(LoadTiers(frozenset()))
        assert settle(manager, blocks, limited) == [False] * 6
        stats = manager.stats()
        assert stats["miss_filtered"] == 6 and stats["disk.miss_filtered"] == 6
        assert_causes_sum(stats)
        assert settle(manager, blocks, ctx) == [True] * 6  # unfiltered, the same blocks come up
    finally:
        manager.shutdown()


def test_blocks_written_without_a_secret_are_foreign_to_a_tier_with_one(tmp_path):
    pytest.importorskip("cryptography")
    ctx = ReqContext("r")
    blocks = [key(i) for i in range(5)]
    store_and_close(disk_stack(tmp_path), blocks, ctx)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    manager = disk_stack(tmp_path, secret_file=str(secret))
    try:
        assert settle(manager, blocks, ctx) == [False] * 5
        stats = manager.stats()
        assert stats["miss_foreign"] == 5 and stats["foreign_secret"] == 5 and stats["disk.miss_foreign"] == 5
        assert_causes_sum(stats)
    finally:
        manager.shutdown()


def test_counts_attribute_to_tiers_and_parts():
    causes = MissCauses(64, ["cpu", "disk"])
    causes.count("corrupt", 1)
    causes.count("foreign", 1, "layout")
    causes.count("new")
    stats = causes.stats()
    assert stats["miss_corrupt"] == 1 and stats["disk.miss_corrupt"] == 1
    assert stats["foreign_layout"] == 1 and stats["disk.miss_foreign"] == 1
    assert stats["miss_new"] == 1 and "disk.miss_new" not in stats


def write_secret(path) -> str:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def test_blocks_under_another_secret_are_foreign_and_a_bad_mac_is_corrupt(tmp_path):
    """The header's key id tells a block written under another secret from a damaged one."""
    pytest.importorskip("cryptography")
    ctx = ReqContext("r")
    blocks = [key(i) for i in range(4)]
    first, second = write_secret(tmp_path / "a"), write_secret(tmp_path / "b")
    store_and_close(disk_stack(tmp_path, secret_file=first), blocks, ctx)
    manager = disk_stack(tmp_path, secret_file=second)
    try:
        assert settle(manager, blocks[:2], ctx) == [False] * 2
        stats = manager.stats()
        assert stats["miss_foreign"] == 2 and stats["foreign_secret"] == 2
        assert stats["disk.corrupt_other_secret"] == 2
    finally:
        manager.shutdown()
    manager = disk_stack(tmp_path, secret_file=first)  # the right secret, one tag altered
    try:
        path, offset = locate(manager.tiers[0], blocks[2])
        flip(path, offset + 4096 + 7)  # a payload byte: the tag no longer holds
        assert settle(manager, blocks[2:], ctx) == [False, True]
        stats = manager.stats()
        assert stats["miss_corrupt"] == 1 and stats["miss_foreign"] == 0
        assert stats["disk.corrupt_MAC"] == 1
    finally:
        manager.shutdown()


def test_config_check_shows_the_sketch_size():
    from kvtier.config import describe

    sized = kvtier.load_config({"tiers": [cpu_section(8)], "miss_causes": {"keys": 4096}})
    assert "miss_causes: 4096 keys remembered" in describe(sized)
    assert "miss_causes: off" in describe(
        kvtier.load_config({"tiers": [cpu_section(8)], "miss_causes": False})
    )


def test_a_failed_read_is_its_askers_one_miss_whoever_finishes_meanwhile(tmp_path):
    """A read that fails is counted as the miss of the lookup that queued it: that asker's
    next lookup is not a second miss, even after another request finished in between (the
    marks once went with any request's end); a later asker's lookup is a miss of its own."""
    ctx, other, later = ReqContext("r"), ReqContext("other"), ReqContext("later")
    blocks = [key(i) for i in range(2)]
    store_and_close(disk_stack(tmp_path), blocks, ctx)
    manager = disk_stack(tmp_path)
    try:
        path, offset = locate(manager.tiers[0], blocks[0])
        flip(path, offset + 4096 + 7)  # a payload byte: the block's checksum fails
        manager.on_new_request(other)
        assert manager.lookup(blocks[0], ctx) is None  # its read is queued
        for _ in range(200):
            if manager.misses:
                break
            manager.on_schedule_end()
            for tier in manager.tiers:
                tier.drain_jobs()
        assert manager.misses == 1 and manager.stats()["miss_corrupt"] == 1
        manager.on_schedule_end()  # a step later the key is no longer refused a row
        manager.on_request_finished(other)
        assert manager.lookup(blocks[0], ctx) is False
        assert manager.misses == 1
        assert manager.lookup(blocks[0], later) is False
        manager.on_schedule_end()
        stats = manager.stats()
        assert manager.misses == 2 and stats["miss_corrupt"] + stats["miss_new"] == 2
        assert_causes_sum(stats)
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("keys", "tag_bits"), [(4, 3), (1000, 4), (50_000, 24)])
def test_the_c_probe_reads_what_numpy_reads(keys, tag_bits):
    """kvtier._speedups' probe (hash, buckets, first matching slot in one C pass) answers each
    key's record as numpy's path does, for any slice of the keys, keys it leaves to Python
    (long, not bytes) included."""
    from kvtier.manager import causes

    if causes.speedups is None:
        pytest.skip("kvtier._speedups is not built here (no C compiler at install)")
    rng = random.Random(keys + tag_bits)
    sketch = CauseSketch(keys, tag_bits=tag_bits)
    stored: list[object] = random_keys(rng, 2 * keys) + [b"x" * 47, b"y" * 99, "ab", (1, 2)]
    records = [rng.randint(STORED, FOREIGN) << 5 | rng.randint(0, 30) for _ in stored]
    sketch.put_records(stored, np.array(records, dtype=np.uint8))  # type: ignore[arg-type]
    probed = stored + random_keys(rng, 2 * keys) + [b"x" * 48, "abc"]
    rng.shuffle(probed)
    probed = probed[:_PROBE_KEYS]
    expected = sketch.records_at(causes.numpy_key_hashes(probed)).tolist()  # type: ignore[arg-type]
    assert any(expected)
    if tag_bits == 24:  # with few tag bits nearly any key matches a slot
        assert not all(expected)
    assert sketch.records(probed).tolist() == expected  # type: ignore[arg-type]
    assert sketch.records(tuple(probed), 3, 40).tolist() == expected[3:40]  # type: ignore[arg-type]
    assert sketch.records(probed, 5, len(probed) + 10).tolist() == expected[5:]  # type: ignore[arg-type]
    assert sketch.records(probed, 7, 7).size == 0  # type: ignore[arg-type]


def test_the_c_hash_is_the_numpy_hash():
    """kvtier._speedups' key_hashes gives every key the hash numpy's path does: keys of every
    length around a row's, keys that are not bytes, a bytes subclass, lists and tuples."""
    from kvtier.manager import causes

    if causes.speedups is None:
        pytest.skip("kvtier._speedups is not built here (no C compiler at install)")

    class Tagged(bytes):
        pass

    rng = random.Random(11)
    keys: list[object] = [rng.randbytes(n) for n in range(100)] + [b"", b"\0", b"ab\0", Tagged(b"ab")]
    keys += ["ab", (1, 2), 7, rng.randbytes(36)]
    assert causes.key_hashes(keys).tolist() == causes.numpy_key_hashes(keys).tolist()  # type: ignore[arg-type]
    assert causes.key_hashes(tuple(keys)).tolist() == causes.numpy_key_hashes(keys).tolist()  # type: ignore[arg-type]
    assert causes.key_hashes([]).size == 0

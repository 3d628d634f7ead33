import gzip
import json

import pytest

from kvtier.errors import KvtierError
from kvtier.replay.trace import (
    BUNDLED_TRACES,
    Request,
    bundled_trace_path,
    ceiling_hit_ratio,
    load_trace,
)


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bundled_trace_matches_its_published_facts():
    requests = load_trace(bundled_trace_path())
    ratio, refs = ceiling_hit_ratio(requests)
    assert len(requests) == 3993 and refs == 121_877
    assert round(ratio, 3) == 0.640
    assert len({h for r in requests for h in r.hash_ids}) == 43_924


def test_bundled_conversation_trace_by_name_matches_its_facts(tmp_path, monkeypatch):
    requests = load_trace("conversation")  # no such file here: the bundled one
    ratio, refs = ceiling_hit_ratio(requests)
    assert len(requests) == 12_031 and refs == 288_500
    assert round(ratio, 3) == 0.366
    assert {r.hash_ids[0] for r in requests} == {0}  # one system prompt opens every request
    assert load_trace(bundled_trace_path("conversation"), limit=3) == requests[:3]
    assert set(BUNDLED_TRACES) == {"synthetic", "conversation"}
    # a file of that name in the working folder is the user's, and wins
    monkeypatch.chdir(tmp_path)
    write_trace(
        tmp_path / "conversation", [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [7]}]
    )
    assert [r.hash_ids for r in load_trace("conversation")] == [(7,)]


def test_gzip_traces_load_like_plain_ones_and_a_damaged_one_is_named(tmp_path):
    records = [
        {"timestamp": i, "input_length": 10, "output_length": 1, "hash_ids": [i, i + 1]} for i in range(50)
    ]
    plain = write_trace(tmp_path / "t.jsonl", records)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(packed) == load_trace(plain)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(KvtierError, match=r"cannot read trace .*cut.jsonl.gz.*whole gzip"):
        load_trace(cut)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe" * 10)
    with pytest.raises(KvtierError, match="Mooncake-format JSONL text file"):
        load_trace(binary)


def test_ceiling_counts_leading_blocks_seen_before():
    requests = [
        Request(0, 0, 0, (1, 2, 3)),
        Request(1, 0, 0, (1, 2, 4)),  # 2 prefix hits
        Request(2, 0, 0, (5, 2, 3)),  # a different first block: no prefix hit at all
    ]
    assert ceiling_hit_ratio(requests) == (2 / 9, 9)


def test_limit_and_blank_lines(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [{"timestamp": i, "input_length": 10, "output_length": 1, "hash_ids": [i]} for i in range(5)],
    )
    path.write_text(path.read_text() + "\n\n")
    assert [r.hash_ids for r in load_trace(path, limit=2)] == [(0,), (1,)]
    assert len(load_trace(path)) == 5


def test_missing_file_and_bad_line_name_the_problem(tmp_path):
    named = r"cannot read trace .* a bundled trace's name \(synthetic, conversation\)"
    with pytest.raises(KvtierError, match=named):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(KvtierError, match="line 2"):
        load_trace(bad)

"""Bad trace input: a named error (file, line, field), exit 2, never a traceback, and the same
answer from ``kvtier replay`` and ``kvtier plan`` (they read traces through one loader)."""

import gzip
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cli.main import main
from kvtier.errors import TraceError
from kvtier.replay.trace import MAX_LINE_CHARS, load_trace, parse_record

GOOD = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}\n'
FIELDS = '"input_length": 1, "output_length": 1'

# (name, the bad line, the field the message must name)
BAD_LINES = [
    (
        "hash id of 2^64",
        f'{{"timestamp": 0, {FIELDS}, "hash_ids": [5, 18446744073709551616]}}',
        "hash_ids[1]",
    ),
    ("negative hash id", f'{{"timestamp": 0, {FIELDS}, "hash_ids": [-1]}}', "hash_ids[0]"),
    ("float hash id", f'{{"timestamp": 0, {FIELDS}, "hash_ids": [1.5]}}', "hash_ids[0]"),
    ("hash_ids a string", f'{{"timestamp": 0, {FIELDS}, "hash_ids": "123"}}', "hash_ids"),
    ("timestamp 1e400", f'{{"timestamp": 1e400, {FIELDS}, "hash_ids": [1]}}', "timestamp"),
    ("timestamp NaN", f'{{"timestamp": NaN, {FIELDS}, "hash_ids": [1]}}', "timestamp"),
    ("timestamp a bool", f'{{"timestamp": true, {FIELDS}, "hash_ids": [1]}}', "timestamp"),
    ("timestamp a string", f'{{"timestamp": "0", {FIELDS}, "hash_ids": [1]}}', "timestamp"),
    (
        "negative length",
        '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}',
        "input_length",
    ),
    (
        "huge length",
        '{"timestamp": 0, "input_length": 1, "output_length": ' + "9" * 40 + ', "hash_ids": [1]}',
        "output_length",
    ),
    ("missing field", '{"timestamp": 0, "input_length": 1, "hash_ids": [1]}', "output_length"),
    ("deeply nested", "[" * 100_000 + "]" * 100_000, "nested"),
    ("not an object", "[1, 2, 3]", "JSON object"),
    ("not JSON", "timestamp=0", "not JSON"),
    ("5000-digit id", f'{{"timestamp": 0, {FIELDS}, "hash_ids": [{"1" * 5000}]}}', "not JSON"),
]


def run_cli(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name, line, field", BAD_LINES, ids=[case[0] for case in BAD_LINES])
@pytest.mark.parametrize("command", ["replay", "plan"])
def test_a_bad_line_is_named_by_both_commands(tmp_path, capsys, command, name, line, field):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + line + "\n" + GOOD)
    extra = ["--no-progress", "--no-baseline"] if command == "replay" else ["--jobs", "1"]
    code, err = run_cli([command, str(path), *extra], capsys)
    assert code == 2
    assert "line 2" in err and field in err, err
    assert "Traceback" not in err and len(err) < 1000


@pytest.mark.parametrize("command", ["replay", "plan"])
def test_dev_zero_is_refused_at_its_first_line_without_reading_it_all(command):
    extra = ["--no-progress"] if command == "replay" else ["--jobs", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", command, "/dev/zero", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "/dev/zero line 1" in done.stderr and "longer than" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_long_line_in_a_gzip_is_refused_too(tmp_path):
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(b" " * (MAX_LINE_CHARS + 10) + b"\n"))
    with pytest.raises(TraceError, match="line 1: longer than"):
        load_trace(path)


def test_edge_values_are_accepted_by_both_commands_alike(tmp_path):
    record = {
        "timestamp": 2**63 - 1,
        "input_length": 0,
        "output_length": 0,
        "hash_ids": [0, 2**64 - 1],
        "extra": "ignored",
    }
    path = tmp_path / "edge.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (request,) = load_trace(path)
    assert request.hash_ids == (0, 2**64 - 1) and request.timestamp_ms == 2**63 - 1
    from kvtier.replay.engine import block_key

    assert len({block_key(h) for h in request.hash_ids}) == 2  # replay can hash every id it loads


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(
                    st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"]),
                    inner,
                    max_size=5,
                )
            ),
            max_leaves=20,
        ).map(json.dumps),
    )
)
def test_the_loader_raises_only_its_own_error_on_any_line(line):
    try:
        request = parse_record(line, "t.jsonl line 1")
    except TraceError as error:
        assert "t.jsonl line 1" in str(error)
    else:
        assert all(0 <= h < 2**64 for h in request.hash_ids)
        assert all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in (request.timestamp_ms, request.input_length, request.output_length)
        )

"""Configuration input of absurd size: refused early, named, and quoted short."""

import subprocess
import sys
import tracemalloc

import pytest

from kvtier.config import MAX_FIELD_INT, describe, format_size, load_config, parse_size
from kvtier.errors import SHOWN_VALUE_CHARS, ConfigError, shown_value

# 9 levels of 9 aliases each: 9^9 (387 million) strings once expanded, from a few hundred bytes
BILLION_LAUGHS = (
    "tiers:\n- kind: cpu\n  capacity: 1GiB\n  eviction: [&a [lol, lol, lol, lol, lol, lol, lol, lol, lol], "
    + ", ".join(f"&{name} [{', '.join(['*' + prev] * 9)}]" for prev, name in zip("abcdefgh", "bcdefghi"))
    + "]\n"
)


def test_nested_aliases_are_refused_before_anything_is_built(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 512
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the full repr of the expansion took gigabytes
    message = str(caught.value)
    assert "line 4" in message and "aliases" in message
    assert len(message) < 1000


def test_nested_aliases_through_the_cli_exit_1_without_a_traceback(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "line 4" in done.stderr and "Traceback" not in done.stderr


def test_a_recursive_alias_is_refused_with_its_line():
    with pytest.raises(ConfigError, match="line 3.*recursive"):
        load_config("tiers:\n- {kind: cpu, capacity: 1GiB}\n- &x [*x]\n")


def test_a_merge_of_a_few_aliases_still_loads():
    text = (
        "tiers:\n- {kind: cpu, capacity: 1GiB}\n- &disk {kind: files, capacity: 1GiB, path: /x, name: a}\n"
        "- {<<: *disk, name: b}\n- {<<: *disk, name: c}\n"
    )
    assert [tier.name for tier in load_config(text).tiers[1:]] == ["a", "b", "c"]


def test_a_megabyte_value_is_truncated_in_the_message():
    huge = "x" * (1 << 20)
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": [{"kind": "cpu", "capacity": huge}]})
    message = str(caught.value)
    assert "tiers[0].capacity" in message and len(message) < 2000
    assert caught.value.value is huge  # the error still carries the whole value for code
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": [{"kind": "cpu", "capacity": "1GiB", huge: 1}]})
    assert len(str(caught.value)) < 2000


def test_shown_value_is_bounded_for_any_shape():
    nested: list = []
    for _ in range(100):
        nested = [nested] * 50
    for value in ("y" * 10**6, 10**41, 10**5000, nested, {str(i): i for i in range(10**4)}, b"z" * 10**6):
        assert len(shown_value(value)) <= SHOWN_VALUE_CHARS
    assert shown_value("tiers") == "'tiers'" and shown_value(4096) == "4096"


@pytest.mark.parametrize(
    "value", ["1" * 41, 10**41, "1" * 41 + "GiB", "9" * 5000, float(2**64), "1" * 5000 + "B"]
)
def test_sizes_past_8_eib_are_named_errors(value):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity"):
        parse_size(value, "tiers[1].capacity")


def test_absurd_counts_are_named_errors():
    with pytest.raises(ConfigError, match="block_size_tokens"):
        load_config({"block_size_tokens": 10**41, "tiers": [{"kind": "cpu", "capacity": "1GiB"}]})


def test_the_largest_size_still_parses_and_formats():
    assert parse_size(MAX_FIELD_INT, "capacity") == MAX_FIELD_INT
    assert format_size(MAX_FIELD_INT).endswith("TiB")
    assert format_size(10**41).endswith("TiB")  # no decimal.InvalidOperation past 10^26
    config = load_config({"tiers": [{"kind": "cpu", "capacity": "4096TiB"}]})
    assert "4096 TiB" in describe(config)


def test_a_41_digit_capacity_through_config_check_exits_1_without_a_traceback(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity: " + "1" * 41 + "}\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "tiers[0].capacity" in done.stderr and "Traceback" not in done.stderr

"""Tests of kvtier.config: sizes, the schema, the source forms and describe()."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import (
    CascadeConfig,
    CPUTierConfig,
    DiskTierConfig,
    KvtierConfig,
    describe,
    format_size,
    load_config,
    parse_size,
)
from kvtier.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The design's example stack, written once as YAML and once as the objects it must become.
STACK_YAML = """\
block_size_tokens: 256
tiers:
  - {name: cpu, kind: cpu, capacity: 64GiB, eviction: arc}
  - {name: nvme, kind: lmdb, path: /mnt/nvme/kvtier, capacity: 2TiB, eviction: lru,
     o_direct: auto, fsync: batch}
cascade: {write_policy: write_back, max_demote_bytes_per_step: 512MiB,
          max_promote_bytes_per_step: 256MiB}
"""
STACK = KvtierConfig(
    tiers=(
        CPUTierConfig(name="cpu", kind="cpu", capacity_bytes=64 * GiB, eviction="arc"),
        DiskTierConfig(
            name="nvme",
            kind="lmdb",
            capacity_bytes=2048 * GiB,
            eviction="lru",
            path="/mnt/nvme/kvtier",
            o_direct="auto",
            fsync="batch",
        ),
    ),
    block_size_tokens=256,
    cascade=CascadeConfig(
        write_policy="write_back",
        max_demote_bytes_per_step=512 * MiB,
        max_promote_bytes_per_step=256 * MiB,
    ),
)


def stack_dict() -> dict:
    """STACK as the dict a caller (or vLLM's extra config) would pass; a fresh copy each time."""
    return {
        "block_size_tokens": 256,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": "64GiB", "eviction": "arc"},
            {
                "name": "nvme",
                "kind": "lmdb",
                "path": "/mnt/nvme/kvtier",
                "capacity": "2TiB",
                "eviction": "lru",
                "o_direct": "auto",
                "fsync": "batch",
            },
        ],
        "cascade": {
            "write_policy": "write_back",
            "max_demote_bytes_per_step": "512MiB",
            "max_promote_bytes_per_step": "256MiB",
        },
    }


def changed(path: tuple, value: object) -> dict:
    """stack_dict() with the item at ``path`` set to ``value`` (or deleted for DELETE)."""
    document = stack_dict()
    *parents, last = path
    target = document
    for step in parents:
        target = target[step]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return document


DELETE = object()


# stands for a key left out: the error then reads "got <missing>"
MISSING = object()


def raises_config_error(source: object, field: str, value: object) -> ConfigError:
    """load_config(source) must raise a ConfigError naming ``field`` and showing ``value``."""
    with pytest.raises(ConfigError) as info:
        load_config(source)
    error = info.value
    assert error.field == field
    assert field in str(error)
    assert ("got <missing>" if value is MISSING else repr(value)) in str(error)
    return error


# --------------------------------------------------------------------------------------------
# parse_size / format_size
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (4096, 4096),
        (1024.0, 1024),
        ("0", 0),
        ("4096", 4096),
        ("4096B", 4096),
        ("4096 b", 4096),
        ("  512MiB  ", 512 * MiB),
        ("2 KiB", 2048),
        ("2KIB", 2048),
        ("2kib", 2048),
        ("64GiB", 64 * GiB),
        ("64gib", 64 * GiB),
        ("64GIB", 64 * GiB),
        ("2TiB", 2 << 40),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1.5MiB", 3 * 512 * 1024),
        ("10kB", 10_000),
        ("10KB", 10_000),
        ("10kb", 10_000),
        ("3MB", 3_000_000),
        ("64GB", 64_000_000_000),
        ("64gb", 64_000_000_000),
        ("1.5TB", 1_500_000_000_000),
        ("1.5tb", 1_500_000_000_000),
        ("+7", 7),
        # exactness: a float would round 0.1 + 0.2 style; Decimal keeps every digit
        ("1.000000000000000000000000001TB", None),
    ],
)
def test_parse_size_accepts(value: object, expected: int | None) -> None:
    if expected is None:
        # 1e-27 TB is not a whole byte: a rounded product would wrongly pass it
        with pytest.raises(ConfigError):
            parse_size(value, "capacity")
    else:
        assert parse_size(value, "capacity") == expected


@pytest.mark.parametrize(
    "value, fix_part",
    [
        ("64G", "64GiB (binary) or 64GB (decimal)"),
        ("64g", "64GiB (binary) or 64GB (decimal)"),
        ("8k", "8KiB (binary) or 8kB (decimal)"),
        ("1M", "1MiB (binary) or 1MB (decimal)"),
        ("2T", "2TiB (binary) or 2TB (decimal)"),
        ("3Gi", "3GiB"),
        ("64GiBs", "did you mean 64GiB?"),
        ("64gb?", "write a size"),
        ("-1", "negative"),
        (-1, "negative"),
        ("- 5MiB", "negative"),
        ("1.5B", "whole number of bytes"),
        ("0.3KiB", "whole number of bytes"),
        (1.5, "whole number of bytes"),
        (float("inf"), "whole number of bytes"),
        (float("nan"), "whole number of bytes"),
        ("abc", "write a size"),
        ("", "write a size"),
        ("1e3", "write a size"),
        ("1,024", "write a size"),
        ("\u0663", "write a size"),  # an Arabic-Indic digit: not ASCII, not a size
        (True, "write a size"),
        (False, "write a size"),
        (None, "write a size"),
        ([1], "write a size"),
        ("64 PiB", "unknown unit 'PiB'"),
    ],
)
def test_parse_size_rejects(value: object, fix_part: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "tiers[0].capacity")
    error = info.value
    assert error.field == "tiers[0].capacity"
    assert error.value is value
    message = str(error)
    assert "tiers[0].capacity" in message
    assert repr(value) in message
    assert fix_part in message
    # the accepted forms are always spelt out
    assert "GiB" in error.expected and "GB" in error.expected


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (3 * 512 * 1024, "1.5 MiB"),
        (512 * MiB, "512 MiB"),
        (64 * GiB, "64 GiB"),
        (2 << 40, "2 TiB"),
        (2048 << 40, "2048 TiB"),
        (1_000_000, "976.56 KiB"),
        (10**12, "931.32 GiB"),
        # rounds to 1024.00 KiB, which reads better one unit up
        (1024 * 1024 - 1, "1 MiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [0, 512, 1024, 1536, 512 * MiB, 64 * GiB, 3 << 39, 2048 << 40])
def test_format_size_of_exact_sizes_parses_back(n: int) -> None:
    assert parse_size(format_size(n), "size") == n


@pytest.mark.parametrize("n, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_format_size_refuses_non_sizes(n: object, error: type) -> None:
    with pytest.raises(error):
        format_size(n)


@given(st.integers(min_value=0, max_value=1 << 60))
def test_parse_size_of_plain_bytes_is_identity(n: int) -> None:
    assert parse_size(n, "f") == parse_size(str(n), "f") == parse_size(f"{n} B", "f") == n


# --------------------------------------------------------------------------------------------
# Source forms: all roads lead to the same KvtierConfig
# --------------------------------------------------------------------------------------------


def test_dict_source() -> None:
    assert load_config(stack_dict()) == STACK


def test_yaml_text_source() -> None:
    assert load_config(STACK_YAML) == STACK


def test_one_line_yaml_text_source() -> None:
    text = "{tiers: [{kind: cpu, capacity: 1GiB}]}"
    assert load_config(text).tiers[0].capacity_bytes == GiB


def test_yaml_file_path_sources(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(STACK_YAML)
    assert load_config(str(path)) == STACK
    assert load_config(path) == STACK


def test_yaml_file_without_yaml_suffix(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.conf"
    path.write_text(STACK_YAML)
    assert load_config(str(path)) == STACK


def test_kvtier_config_instance_is_returned_as_is() -> None:
    assert load_config(STACK) is STACK


def test_extra_config_with_kvtier_config_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiers.yaml").write_text(STACK_YAML)
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "kvtier_config": str(tmp_path / "tiers.yaml"),
    }
    assert load_config(extra) == STACK
    # a relative path resolves against the current directory
    monkeypatch.chdir(tmp_path)
    assert load_config({**extra, "kvtier_config": "tiers.yaml"}) == STACK
    assert load_config({**extra, "kvtier_config": Path("tiers.yaml")}) == STACK


def test_extra_config_inline_with_vllm_passthrough_keys() -> None:
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "offload_prompt_only": True,
        **stack_dict(),
    }
    assert load_config(extra) == STACK


def test_vllm_block_size_is_an_alias() -> None:
    document = changed(("block_size_tokens",), DELETE)
    assert load_config({**document, "block_size": 256}) == STACK
    # both given and equal is fine
    assert load_config({**stack_dict(), "block_size": 256}) == STACK


def test_vllm_block_size_fills_in_for_an_included_file(tmp_path: Path) -> None:
    (tmp_path / "tiers.yaml").write_text(STACK_YAML.replace("block_size_tokens: 256\n", ""))
    config = load_config({"kvtier_config": str(tmp_path / "tiers.yaml"), "block_size": 256})
    assert config == STACK
    # and agrees with a file that sets the same value
    (tmp_path / "same.yaml").write_text(STACK_YAML)
    assert load_config({"kvtier_config": str(tmp_path / "same.yaml"), "block_size": 256}) == STACK


def test_defaults() -> None:
    config = load_config({"tiers": [{"kind": "cpu", "capacity": 4096}]})
    assert config == KvtierConfig(tiers=(CPUTierConfig(name="cpu", kind="cpu", capacity_bytes=4096),))
    assert config.block_size_tokens is None
    assert config.cascade == CascadeConfig()
    tier = config.tiers[0]
    assert (tier.eviction, tier.path, tier.pin_memory) == ("lru", None, "auto")


def test_disk_tier_defaults_and_name_from_kind() -> None:
    config = load_config("tiers:\n- {kind: cpu, capacity: 1GiB}\n- {kind: files, capacity: 1GiB, path: /x}\n")
    disk = config.tiers[1]
    assert isinstance(disk, DiskTierConfig)
    assert (disk.name, disk.o_direct, disk.fsync) == ("files", "auto", "batch")


@pytest.mark.parametrize(
    "text, option, expected",
    [
        ("pin_memory: off", "pin_memory", "off"),
        ("pin_memory: on", "pin_memory", "on"),
        ("pin_memory: false", "pin_memory", "off"),
        ("pin_memory: 'auto'", "pin_memory", "auto"),
    ],
)
def test_yaml_booleans_map_to_on_off_for_cpu(text: str, option: str, expected: str) -> None:
    config = load_config(f"tiers:\n- {{kind: cpu, capacity: 1GiB, {text}}}\n")
    assert getattr(config.tiers[0], option) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("o_direct: off", "off"), ("o_direct: true", "on"), ("o_direct: 'on'", "on")],
)
def test_yaml_booleans_map_to_on_off_for_disk(text: str, expected: str) -> None:
    config = load_config(
        f"tiers:\n- {{kind: cpu, capacity: 1GiB}}\n- {{kind: lmdb, capacity: 1GiB, path: /x, {text}}}\n"
    )
    assert config.tiers[1].o_direct == expected


def test_out_of_tree_eviction_accepts_any_class_name() -> None:
    document = changed(("tiers", 1, "eviction"), "TwoQueuePolicy")
    document["tiers"][1]["eviction_module_path"] = "my_pkg.policies"
    tier = load_config(document).tiers[1]
    assert (tier.eviction, tier.eviction_module_path) == ("TwoQueuePolicy", "my_pkg.policies")


def test_path_like_tier_path_becomes_str() -> None:
    document = changed(("tiers", 1, "path"), Path("/mnt/nvme/kvtier"))
    assert load_config(document) == STACK


def test_tiers_may_be_a_tuple() -> None:
    document = stack_dict()
    document["tiers"] = tuple(document["tiers"])
    assert load_config(document) == STACK


def test_yaml_merge_keys_still_work() -> None:
    # the duplicate-key check must leave `<<:` overrides alone
    text = (
        "tiers:\n- {kind: cpu, capacity: 1GiB}\n"
        "- &disk {kind: files, capacity: 1GiB, path: /x, name: a}\n"
        "- {<<: *disk, name: b, capacity: 2GiB}\n"
    )
    tiers = load_config(text).tiers
    assert [(t.name, t.capacity_bytes) for t in tiers[1:]] == [("a", GiB), ("b", 2 * GiB)]


# --------------------------------------------------------------------------------------------
# Schema errors: each names the field path and the offending value
# --------------------------------------------------------------------------------------------

UNKNOWN_KEYS = [
    # (where the typo goes, its key, the field path, the suggested key)
    ((), "tyers", "tyers", "tiers"),
    ((), "block_size_token", "block_size_token", "block_size_tokens"),
    ((), "spec_nam", "spec_nam", "spec_name"),
    (("tiers", 0), "evction", "tiers[0].evction", "eviction"),
    (("tiers", 0), "pin_memroy", "tiers[0].pin_memroy", "pin_memory"),
    (("tiers", 1), "capacty", "tiers[1].capacty", "capacity"),
    (("tiers", 1), "fsyn", "tiers[1].fsyn", "fsync"),
    (("cascade",), "write_polcy", "cascade.write_polcy", "write_policy"),
    (("cascade",), "max_demote_bytes", "cascade.max_demote_bytes", "max_demote_bytes_per_step"),
]


@pytest.mark.parametrize("where, key, field, suggestion", UNKNOWN_KEYS)
def test_unknown_key_is_an_error_with_a_suggestion(
    where: tuple, key: str, field: str, suggestion: str
) -> None:
    document = stack_dict()
    target = document
    for step in where:
        target = target[step]
    target[key] = "x"
    error = raises_config_error(document, field, key)
    assert f"did you mean '{suggestion}'?" in str(error)
    # the valid keys are listed
    assert suggestion in error.expected


@pytest.mark.parametrize(
    "where, field",
    [((), "zzz"), (("tiers", 0), "tiers[0].zzz"), (("cascade",), "cascade.zzz")],
)
def test_unknown_key_without_a_close_match(where: tuple, field: str) -> None:
    document = stack_dict()
    target = document
    for step in where:
        target = target[step]
    target["zzz"] = 1
    error = raises_config_error(document, field, "zzz")
    assert "did you mean" not in str(error)


def test_non_string_key_is_an_error() -> None:
    document = stack_dict()
    document["tiers"][0][7] = "x"
    raises_config_error(document, "tiers[0].7", 7)


@pytest.mark.parametrize(
    "kind_index, key, value, owners",
    [
        (0, "fsync", "batch", "lmdb and files"),
        (0, "o_direct", "auto", "lmdb and files"),
        (1, "pin_memory", "auto", "cpu"),
    ],
)
def test_key_of_another_kind_says_which_kinds_take_it(
    kind_index: int, key: str, value: str, owners: str
) -> None:
    document = changed(("tiers", kind_index, key), value)
    error = raises_config_error(document, f"tiers[{kind_index}].{key}", key)
    assert f"only to tiers of kind {owners}" in str(error)


SCHEMA_ERRORS = [
    # (id, path in stack_dict, new value, field path, offending value)
    ("tiers missing", ("tiers",), DELETE, "tiers", MISSING),
    ("tiers empty", ("tiers",), [], "tiers", []),
    ("tiers a mapping", ("tiers",), {"kind": "cpu"}, "tiers", {"kind": "cpu"}),
    ("tiers a string", ("tiers",), "cpu", "tiers", "cpu"),
    ("tiers null", ("tiers",), None, "tiers", None),
    ("tier a string", ("tiers", 1), "lmdb", "tiers[1]", "lmdb"),
    ("tier a list", ("tiers", 1), ["kind", "lmdb"], "tiers[1]", ["kind", "lmdb"]),
    ("kind missing", ("tiers", 1, "kind"), DELETE, "tiers[1].kind", MISSING),
    ("kind unknown", ("tiers", 1, "kind"), "disk", "tiers[1].kind", "disk"),
    ("kind typo", ("tiers", 1, "kind"), "lmbd", "tiers[1].kind", "lmbd"),
    ("kind a number", ("tiers", 1, "kind"), 3, "tiers[1].kind", 3),
    ("kind a list", ("tiers", 1, "kind"), ["lmdb"], "tiers[1].kind", ["lmdb"]),
    ("capacity missing", ("tiers", 0, "capacity"), DELETE, "tiers[0].capacity", MISSING),
    ("capacity 64G", ("tiers", 0, "capacity"), "64G", "tiers[0].capacity", "64G"),
    ("capacity -1", ("tiers", 1, "capacity"), "-1", "tiers[1].capacity", "-1"),
    ("capacity int -1", ("tiers", 1, "capacity"), -1, "tiers[1].capacity", -1),
    ("capacity 1.5B", ("tiers", 1, "capacity"), "1.5B", "tiers[1].capacity", "1.5B"),
    ("capacity abc", ("tiers", 1, "capacity"), "abc", "tiers[1].capacity", "abc"),
    ("capacity True", ("tiers", 1, "capacity"), True, "tiers[1].capacity", True),
    ("capacity zero", ("tiers", 1, "capacity"), 0, "tiers[1].capacity", 0),
    ("capacity 0GiB", ("tiers", 1, "capacity"), "0GiB", "tiers[1].capacity", "0GiB"),
    ("capacity null", ("tiers", 1, "capacity"), None, "tiers[1].capacity", None),
    ("path missing", ("tiers", 1, "path"), DELETE, "tiers[1].path", MISSING),
    ("path null", ("tiers", 1, "path"), None, "tiers[1].path", None),
    ("path empty", ("tiers", 1, "path"), "", "tiers[1].path", ""),
    ("path a number", ("tiers", 1, "path"), 5, "tiers[1].path", 5),
    ("cpu path empty", ("tiers", 0, "path"), "  ", "tiers[0].path", "  "),
    ("name a number", ("tiers", 1, "name"), 12, "tiers[1].name", 12),
    ("name empty", ("tiers", 1, "name"), "", "tiers[1].name", ""),
    ("name with space", ("tiers", 1, "name"), "nv me", "tiers[1].name", "nv me"),
    ("name with newline", ("tiers", 1, "name"), "nvme\n", "tiers[1].name", "nvme\n"),
    ("name duplicate", ("tiers", 1, "name"), "cpu", "tiers[1].name", "cpu"),
    ("eviction unknown", ("tiers", 1, "eviction"), "fifo", "tiers[1].eviction", "fifo"),
    ("eviction case", ("tiers", 0, "eviction"), "ARC", "tiers[0].eviction", "ARC"),
    ("eviction a number", ("tiers", 0, "eviction"), 1, "tiers[0].eviction", 1),
    (
        "module path empty",
        ("tiers", 0, "eviction_module_path"),
        "",
        "tiers[0].eviction_module_path",
        "",
    ),
    ("pin_memory bad", ("tiers", 0, "pin_memory"), "yes", "tiers[0].pin_memory", "yes"),
    ("pin_memory int", ("tiers", 0, "pin_memory"), 1, "tiers[0].pin_memory", 1),
    ("o_direct bad", ("tiers", 1, "o_direct"), "sometimes", "tiers[1].o_direct", "sometimes"),
    ("fsync bad", ("tiers", 1, "fsync"), "never", "tiers[1].fsync", "never"),
    # fsync has three settings, so a boolean cannot say which one was meant
    ("fsync boolean", ("tiers", 1, "fsync"), False, "tiers[1].fsync", False),
    (
        "first tier not cpu",
        ("tiers", 0),
        {"kind": "files", "capacity": 1, "path": "/x"},
        "tiers[0].kind",
        "files",
    ),
    (
        "second cpu tier",
        ("tiers", 1),
        {"name": "c2", "kind": "cpu", "capacity": 1},
        "tiers[1].kind",
        "cpu",
    ),
    ("cascade a list", ("cascade",), [], "cascade", []),
    ("cascade null", ("cascade",), None, "cascade", None),
    (
        "write_policy bad",
        ("cascade", "write_policy"),
        "writeback",
        "cascade.write_policy",
        "writeback",
    ),
    (
        "demote 64G",
        ("cascade", "max_demote_bytes_per_step"),
        "64G",
        "cascade.max_demote_bytes_per_step",
        "64G",
    ),
    (
        "promote zero",
        ("cascade", "max_promote_bytes_per_step"),
        0,
        "cascade.max_promote_bytes_per_step",
        0,
    ),
    ("block size zero", ("block_size_tokens",), 0, "block_size_tokens", 0),
    ("block size negative", ("block_size_tokens",), -16, "block_size_tokens", -16),
    ("block size a string", ("block_size_tokens",), "256", "block_size_tokens", "256"),
    ("block size a float", ("block_size_tokens",), 256.0, "block_size_tokens", 256.0),
    ("block size a bool", ("block_size_tokens",), True, "block_size_tokens", True),
    ("vllm block size zero", ("block_size",), 0, "block_size", 0),
    ("block size conflict", ("block_size",), 128, "block_size", 128),
]


@pytest.mark.parametrize(
    "path, value, field, shown",
    [case[1:] for case in SCHEMA_ERRORS],
    ids=[case[0] for case in SCHEMA_ERRORS],
)
def test_schema_error(path: tuple, value: object, field: str, shown: object) -> None:
    raises_config_error(changed(path, value), field, shown)


@pytest.mark.parametrize(
    "path, value, fix_part",
    [
        (("tiers", 1, "kind"), "lmbd", "did you mean 'lmdb'?"),
        (("tiers", 0, "eviction"), "ARC", "did you mean 'arc'?"),
        (("tiers", 1, "eviction"), "fifo", "eviction_module_path"),
        (("cascade", "write_policy"), "writeback", "did you mean 'write_back'?"),
        (("tiers", 1, "fsync"), "never", "none, batch, always"),
        (("tiers", 1, "name"), "cpu", "tiers[0] has it"),
        (("block_size",), 128, "give only one of block_size and block_size_tokens"),
    ],
)
def test_schema_error_fix(path: tuple, value: object, fix_part: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(changed(path, value))
    assert fix_part in str(info.value)


def test_first_tier_not_cpu() -> None:
    document = stack_dict()
    document["tiers"].reverse()
    error = raises_config_error(document, "tiers[0].kind", "lmdb")
    assert "move tiers[1] (kind cpu) first" in str(error)
    assert "GPU" in str(error)
    document = changed(("tiers", 0), {"kind": "files", "capacity": 1, "path": "/x"})
    error = raises_config_error(document, "tiers[0].kind", "files")
    assert "add a tier of kind cpu first" in str(error)


def test_default_names_collide() -> None:
    text = (
        "tiers:\n- {kind: cpu, capacity: 1GiB}\n- {kind: lmdb, capacity: 1GiB, path: /a}\n"
        "- {kind: lmdb, capacity: 1GiB, path: /b}\n"
    )
    raises_config_error(text, "tiers[2].name", "lmdb")


def test_eviction_without_module_path_is_checked() -> None:
    document = changed(("tiers", 0, "eviction"), "TwoQueuePolicy")
    error = raises_config_error(document, "tiers[0].eviction", "TwoQueuePolicy")
    assert "lru, arc" in error.expected


# --------------------------------------------------------------------------------------------
# Source errors
# --------------------------------------------------------------------------------------------


def test_kvtier_config_with_inline_keys_is_ambiguous(tmp_path: Path) -> None:
    (tmp_path / "tiers.yaml").write_text(STACK_YAML)
    for key in ("tiers", "cascade", "block_size_tokens"):
        extra = {"kvtier_config": str(tmp_path / "tiers.yaml"), key: stack_dict()[key]}
        error = raises_config_error(extra, "kvtier_config", str(tmp_path / "tiers.yaml"))
        assert "give either kvtier_config or inline keys" in str(error)
        assert key in str(error)


def test_kvtier_config_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    error = raises_config_error({"kvtier_config": missing}, "kvtier_config", missing)
    assert "check the path" in str(error)


@pytest.mark.parametrize("value", [5, "", None, ["a.yaml"]])
def test_kvtier_config_not_a_path(value: object) -> None:
    raises_config_error({"kvtier_config": value}, "kvtier_config", value)


def test_kvtier_config_conflicting_block_size(tmp_path: Path) -> None:
    (tmp_path / "tiers.yaml").write_text(STACK_YAML)
    extra = {"kvtier_config": str(tmp_path / "tiers.yaml"), "block_size": 16}
    error = raises_config_error(extra, "block_size", 16)
    assert "256" in str(error)


def test_nested_kvtier_config_in_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "inner.yaml").write_text(STACK_YAML)
    (tmp_path / "outer.yaml").write_text(f"kvtier_config: {tmp_path / 'inner.yaml'}\n")
    extra = {"kvtier_config": str(tmp_path / "outer.yaml")}
    error = raises_config_error(extra, "kvtier_config", str(tmp_path / "inner.yaml"))
    assert "cannot include another" in str(error)
    raises_config_error(str(tmp_path / "outer.yaml"), "kvtier_config", str(tmp_path / "inner.yaml"))


@pytest.mark.parametrize(
    "key, value",
    [("spec_name", "TieredOffloadingSpec"), ("offload_prompt_only", True), ("block_size", 16)],
)
def test_vllm_keys_belong_in_the_extra_config_not_the_yaml(key: str, value: object) -> None:
    text = STACK_YAML + f"{key}: {str(value).lower() if value is True else value}\n"
    error = raises_config_error(text, key, value)
    assert "kv_connector_extra_config" in str(error)


@pytest.mark.parametrize("name", ["nope.yaml", "nope.yml", "nope", "C:/kvtier/nope.yaml"])
def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    error = raises_config_error(name, "config", name)
    assert "check the path" in str(error)
    assert "an existing kvtier YAML file" in error.expected


def test_missing_path_like(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    raises_config_error(path, "config", str(path))


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    error = raises_config_error(str(tmp_path), "config", str(tmp_path))
    assert "directory" in str(error)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"tiers: [{kind: cpu, capacity: 1GiB, name: caf\xe9}]\n")
    error = raises_config_error(path, "config", str(path))
    assert "UTF-8" in str(error)


@pytest.mark.parametrize(
    "text, where, shown, problem",
    [
        (
            "tiers:\n  - {kind: cpu, capacity: 1GiB\n",
            "line 3, column 1",
            "<end of input>",
            "flow mapping at line 2, column 5",
        ),
        ("a: b: c\n", "line 1, column 5", "a: b: c", "mapping values are not allowed"),
        ("tiers:\n\t- x\n", "line 2, column 1", "- x", "cannot start any token"),
        (
            "tiers:\n- kind: cpu\n  capacity: 1GiB\n  capacity: 2GiB\n",
            "line 4, column 3",
            "capacity: 2GiB",
            "duplicate key 'capacity'",
        ),
        ("tiers: []\ntiers: []\n", "line 2, column 1", "tiers: []", "duplicate key 'tiers'"),
    ],
)
def test_invalid_yaml_text(text: str, where: str, shown: str, problem: str) -> None:
    error = raises_config_error(text, f"YAML text {where}", shown)
    assert problem in str(error)


def test_invalid_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("tiers:\n  - name: cpu\n   kind: cpu\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field.startswith(str(path))
    assert "line 3, column 4" in str(info.value)


@pytest.mark.parametrize(
    "text, shown",
    [
        ("- a\n- b\n", ["a", "b"]),
        ("just text\n", "just text"),
        ("42\n", 42),
        ("# a comment\n", None),
    ],
)
def test_top_level_not_a_mapping(text: str, shown: object) -> None:
    error = raises_config_error(text, "YAML text", shown)
    assert "mapping" in error.expected


def test_empty_file_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    raises_config_error(path, str(path), None)


@pytest.mark.parametrize("source", [3, None, b"tiers: []", ["tiers"], "", "   "])
def test_unsupported_source(source: object) -> None:
    raises_config_error(source, "config", source)


def test_only_config_errors_escape_on_wrong_types_everywhere() -> None:
    """Every node replaced by a value of the wrong type gives a ConfigError, nothing else."""
    wrong = [None, 0, -1, True, 1.5, "", "x", [], [1], {}, {"a": 1}]
    paths = [()]
    document = stack_dict()
    for key, value in document.items():
        paths.append((key,))
        if isinstance(value, dict):
            paths += [(key, k) for k in value]
        if isinstance(value, list):
            for index, tier in enumerate(value):
                paths.append((key, index))
                paths += [(key, index, k) for k in tier]
    for path in paths:
        rejected = 0
        for value in wrong:
            source = value if not path else changed(path, value)
            try:
                load_config(copy.deepcopy(source))
            except ConfigError:  # anything else escaping fails the test
                rejected += 1
        assert rejected, f"no wrong value was rejected at {path}"


# Values drawn near the schema, so that the fuzzing reaches the deep branches.
_KEYS = st.sampled_from(
    [
        "tiers",
        "cascade",
        "block_size_tokens",
        "block_size",
        "kind",
        "name",
        "capacity",
        "eviction",
        "eviction_module_path",
        "path",
        "pin_memory",
        "o_direct",
        "fsync",
        "write_policy",
        "max_demote_bytes_per_step",
        "spec_name",
        "x",
    ]
)
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.sampled_from(["cpu", "lmdb", "files", "lru", "arc", "64GiB", "64G", "on", "batch", "/x"]),
)
_NODES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=5)),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_KEYS, _NODES, max_size=4))
def test_fuzzed_documents_raise_only_config_error(document: dict) -> None:
    try:
        config = load_config(document)
    except ConfigError:
        return
    assert isinstance(config, KvtierConfig)


# --------------------------------------------------------------------------------------------
# Frozen objects, describe() and the shipped examples
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, name",
    [
        (STACK, "tiers"),
        (STACK, "block_size_tokens"),
        (STACK.tiers[0], "capacity_bytes"),
        (STACK.tiers[0], "pin_memory"),
        (STACK.tiers[1], "fsync"),
        (STACK.cascade, "write_policy"),
    ],
)
def test_config_objects_are_frozen(target: object, name: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(target, name, None)


def test_describe_names_every_tier_and_setting() -> None:
    text = describe(STACK)
    for expected in (
        "cpu",
        "nvme",
        "lmdb",
        "64 GiB",
        "2 TiB",
        "arc",
        "lru",
        "/mnt/nvme/kvtier",
        "pin_memory=auto",
        "o_direct=auto",
        "fsync=batch",
        "256",
        "write_back",
        "512 MiB",
        "256 MiB",
    ):
        assert expected in text
    lines = text.splitlines()
    assert lines[1].lstrip().startswith("[0]") and "cpu" in lines[1]
    assert lines[2].lstrip().startswith("[1]") and "nvme" in lines[2]


def test_describe_shows_exact_bytes_when_rounded_and_defaults() -> None:
    config = KvtierConfig(
        tiers=(
            CPUTierConfig(
                name="c",
                kind="cpu",
                capacity_bytes=10**12,
                eviction="TwoQueue",
                eviction_module_path="my.policies",
            ),
        )
    )
    text = describe(config)
    assert "931.32 GiB (1000000000000 B)" in text
    assert "TwoQueue (from my.policies)" in text
    assert "/dev/shm" in text
    assert "engine's GPU block size" in text


def test_examples_exist() -> None:
    names = {path.name for path in EXAMPLES.glob("*.yaml")}
    assert {"cpu-only.yaml", "cpu-lmdb.yaml", "cpu-files.yaml"} <= names


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_parses(path: Path) -> None:
    config = load_config(path)
    assert config.tiers[0].kind == "cpu"
    for tier in config.tiers:
        assert tier.name in describe(config)


def test_disk_examples_match_the_brief() -> None:
    for kind in ("lmdb", "files"):
        config = load_config(EXAMPLES / f"cpu-{kind}.yaml")
        cpu, disk = config.tiers
        assert (cpu.kind, cpu.capacity_bytes, cpu.eviction) == ("cpu", 8 * GiB, "arc")
        assert (disk.kind, disk.capacity_bytes) == (kind, 100 * GiB)
        assert disk.path == f"~/.cache/kvtier/{kind}"  # per user, never a world-writable /var/tmp
    only = load_config(EXAMPLES / "cpu-only.yaml")
    assert [(t.kind, t.capacity_bytes, t.eviction) for t in only.tiers] == [("cpu", 4 * GiB, "lru")]


def test_kind_sections_live_beside_their_tiers_and_old_names_still_work() -> None:
    import kvtier
    import kvtier.config as config_module
    from kvtier.tiers.cpu.config import CPUTierConfig as cpu_section
    from kvtier.tiers.disk.config import DiskTierConfig as disk_section

    assert config_module.CPUTierConfig is cpu_section is kvtier.CPUTierConfig
    assert config_module.DiskTierConfig is disk_section is kvtier.DiskTierConfig
    assert issubclass(disk_section, kvtier.TierConfig)
    assert "path" not in {f.name for f in dataclasses.fields(kvtier.TierConfig)}  # kinds own it
    with pytest.raises(AttributeError):
        config_module.NoSuchTierConfig  # noqa: B018


def test_disk_tier_io_threads() -> None:
    base = "tiers:\n- {kind: cpu, capacity: 1GiB}\n- {kind: lmdb, capacity: 1GiB, path: /x"
    assert load_config(base + "}\n").tiers[1].threads == 16
    assert load_config(base + ", threads: 4}\n").tiers[1].threads == 4
    for bad in (0, 1000, "many"):
        error = raises_config_error(base + f", threads: {bad}}}\n", "tiers[1].threads", bad)
        assert error.fix

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.main import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "config" in out and "bench" in out


def test_bare_kvtier_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvtier") and "replay" in out and "stats" in out


@pytest.mark.parametrize("command", ["replay", "plan"])
def test_trace_help_names_the_bundled_traces(command, capsys):
    from kvtier.replay.trace import BUNDLED_TRACES

    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in BUNDLED_TRACES) and "conversation" in help_text


def test_installed_entry_point_runs():
    # the console script is what users type; make sure it is wired to main()
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kvtier"), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "usage: kvtier" in result.stdout


def test_config_check_prints_the_stack(tmp_path, capsys):
    example = (EXAMPLES / "cpu-lmdb.yaml").read_text()
    local = example.replace("~/.cache/kvtier/lmdb", str(tmp_path / "lmdb")).replace("100GiB", "1GiB")
    (tmp_path / "stack.yaml").write_text(local)
    assert main(["config", "check", str(tmp_path / "stack.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "lmdb" in out and "1 GiB" in out


@pytest.mark.parametrize(
    ("admission", "shown", "hidden"),
    [
        ("admit: all", ["admit=all"], ["min_reuse", "drive_bytes", "budget_window_s"]),
        ("admit: reuse, min_reuse: 3", ["admit=reuse", "min_reuse=3"], ["budget_window_s"]),
        (
            "admit: budget, drive_writes_per_day: 1, drive_bytes: 1TiB",
            ["admit=budget", "drive_bytes=1 TiB", "budget_window_s=3600.0"],
            ["min_reuse"],
        ),
    ],
)
def test_config_check_shows_the_keys_that_act_in_units(tmp_path, capsys, admission, shown, hidden):
    """No None, no raw byte count, no key the chosen admission does not read."""
    path = tmp_path / "stack.yaml"
    path.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 1MiB}\n"
        f"  - {{name: disk, kind: lmdb, path: {tmp_path / 'store'}, capacity: 64MiB, {admission}}}\n"
        "  - {name: shared, kind: valkey, url: valkey://127.0.0.1:6379/0}\n"
    )
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    disk = next(line for line in out.splitlines() if " lmdb " in line)
    shared = next(line for line in out.splitlines() if " valkey " in line)
    assert "None" not in out and "max_inflight_bytes=256 MiB" in shared and "(server's)" in shared
    assert all(key in disk for key in shown), disk
    assert not any(key in disk for key in hidden), disk
    assert "encrypt" not in disk  # encrypt needs a secret_file, and none is given


def test_config_check_measures_a_home_path_where_the_store_opens(tmp_path, capsys, monkeypatch):
    """~ in a disk tier's path is the home directory there too, not a folder named ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    path = tmp_path / "home.yaml"
    path.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 1MiB}\n"
        f"  - {{name: disk, kind: files, path: ~/store, capacity: {2 * free}}}\n"
    )
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"fits in {tmp_path / 'store'}:" in err and "~" not in err.split("fits in")[1].split(":")[0]


def test_config_check_refuses_a_disk_tier_larger_than_its_disk(tmp_path, capsys):
    """The strict check an engine's open is not: a capacity beyond what the store holds plus
    the free space is an error naming the field, the room and the fix."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    path = tmp_path / "big.yaml"
    path.write_text(
        f"tiers:\n  - {{name: cpu, kind: cpu, capacity: 1MiB}}\n"
        f"  - {{name: disk, kind: files, path: {tmp_path / 'store'}, capacity: {2 * free}}}\n"
    )
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "tiers[1].capacity" in err and "free there" in err and "lower the capacity" in err


def test_config_check_names_the_bad_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {kind: cpu, capacity: 4GiB, evicton: lru}\n")
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "tiers[0].evicton" in err and "did you mean 'eviction'" in err


def test_config_check_missing_file(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_manager_json_has_every_figure(capsys):
    assert main(["bench", "manager", "--json", "--keys", "2000", "--capacity", "1000", "--runs", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "manager" and record["baseline"] in ("vllm", "reference")
    from kvtier.manager.causes import speedups

    assert record["speedups"] is (speedups is not None)
    combos = {(row["policy"], row["keys_per_call"]) for row in record["rows"]}
    assert combos == {("lru", 64), ("lru", 1), ("arc", 64), ("arc", 1)}
    for row in record["rows"]:
        for figure in ("store_us", "lookup_us", "load_us", "metadata_bytes_per_block"):
            assert row[figure] > 0
        assert row["metadata_bytes_per_block_incl_keys"] > row["metadata_bytes_per_block"]


def test_bench_manager_lookup_floor_times_each_subject_per_policy(capsys):
    args = "bench manager --lookup-floor --json --keys 2000 --capacity 1000 --runs 2".split()
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "manager_lookup_floor" and record["runs"] == 2
    subjects = {"dict probe, inline", "dict probe in a function", "hash of each missed key", "kvtier"}
    subjects.add("kvtier, miss_causes off")
    if record["baseline"] == "vllm":
        subjects.add("vllm")
    for policy in ("lru", "arc"):
        rows = [row for row in record["rows"] if row["policy"] == policy]
        assert {row["subject"] for row in rows} == subjects
        for row in rows:
            assert 0 < row["ns_min"] <= row["ns_median"] <= row["ns_max"]


def test_bench_disk_with_a_missing_dir_names_it_and_the_fix(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["bench", "disk", "--backend", "files", "--gib", "0.01", "--dir", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "--dir" in err and str(missing) in err and "mkdir -p" in err


def test_bench_disk_at_the_baselines_durability_reports_each_rounds_spread(tmp_path, capsys):
    """``--fsync end``: the tier unflushed, one flush at the end (the raw baseline's
    durability). Every block still goes through the tier and comes back as stored (the bench
    checks each row); the record gives the rounds' spread, the load and both sides' CPU."""
    argv = ["bench", "disk", "--backend", "files", "--gib", "0.004", "--rounds", "3", "--open-blocks", "0"]
    assert (
        main(
            [*argv, "--threads", "2", "--dir", str(tmp_path), "--no-drop-caches", "--fsync", "end", "--json"]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["fsync"] == "end" and record["rounds"] == 3
    for name in ("write_ratio", "read_ratio", "full_write_ratio"):
        low, high = record[f"{name}_range"]
        assert low <= record[name] <= high
        rounds = sorted(sample[name] for sample in record["samples"])
        assert [rounds[0], rounds[-1]] == [low, high]
    assert record["load_range"][0] <= record["load_range"][1] and record["load_before"] >= 0
    assert record["write_cpu_s_per_gb"] > 0 and record["baseline_write_cpu_s_per_gb"] >= 0
    assert list(tmp_path.iterdir()) == []  # every store and the baseline's file removed

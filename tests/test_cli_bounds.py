"""Issue #32, item 6: command-line values out of bounds, unwritable plot paths, a device for a
configuration, bad URLs and files a configuration names are each a clear error (exit 2, or 1
for ``config check``'s "invalid"), never a traceback, a hang or a run that takes the machine."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvtier
from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.errors import ConfigError

#: the kvtier under test (the subprocesses run the same code as this one)
KVTIER_SRC = str(Path(kvtier.__file__).resolve().parents[1])
DOCS = Path(__file__).resolve().parents[1] / "docs"


def usage_error(capsys, argv, option):
    """``argv`` stops at argument parsing: exit 2 naming ``option``."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "out of range" in err and "Traceback" not in err, err


def tiny_trace(path: Path) -> str:
    chains = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7], [5, 6, 8]]
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": c})
            + "\n"
            for i, c in enumerate(chains)
        )
    )
    return str(path)


@pytest.mark.parametrize("value", ["-1", "0"])
@pytest.mark.parametrize("command", [["replay", "--no-progress"], ["bench", "cascade"]])
def test_a_limit_below_one_is_a_usage_error(capsys, tmp_path, monkeypatch, command, value):
    monkeypatch.chdir(tmp_path)
    usage_error(capsys, [*command, "--limit", value], "--limit")


def test_a_gpu_cache_larger_than_the_machine_is_refused_before_it_is_allocated(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["replay", "--gpu-blocks", str(10**14), "--limit", "3", "--no-progress", "--no-baseline"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--gpu-blocks 100000000000000" in err and "memory" in err and "lower --gpu-blocks" in err
    assert list(tmp_path.iterdir()) == []  # the temporary store went with the refusal


def test_capacities_beyond_the_trace_plan_as_the_trace_s_distinct_blocks(capsys, tmp_path):
    """A cache that never evicts: 10^14 blocks give what 8 (the trace's distinct blocks) give,
    computed without allocating a slot per block."""
    trace = tiny_trace(tmp_path / "t.jsonl")
    common = ["plan", trace, "--policies", "lru", "--jobs", "1", "--json"]
    assert main([*common, "--capacities", "8", str(10**14)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["capacities"] == [8, 10**14]
    assert record["hit_ratio"]["lru"][0] == record["hit_ratio"]["lru"][1] == record["ceiling"] > 0
    assert record["opt"][1] == record["opt"][0]


@pytest.mark.parametrize("command", ["replay", "plan"])
def test_a_plot_that_cannot_be_written_is_a_clear_error(capsys, tmp_path, monkeypatch, command):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    trace = tiny_trace(tmp_path / "t.jsonl")
    extra = (
        ["--no-progress", "--no-baseline"] if command == "replay" else ["--jobs", "1", "--capacities", "4"]
    )
    assert main([command, trace, *extra, "--plot", "/proc/kvtier-plot.png"]) == 2
    err = capsys.readouterr().err
    assert "--plot /proc/kvtier-plot.png: the plot cannot be written there" in err


def test_config_check_of_a_device_reads_a_bounded_amount(tmp_path):
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # an unbounded read fails, not the machine

    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "config", "check", "/dev/zero"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": KVTIER_SRC},
            timeout=60,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("kvtier config check /dev/zero was still reading after 60 s")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "/dev/zero: invalid" in result.stderr and "at most 1048576 characters" in result.stderr


def write_config(tmp_path, **tier_options):
    nvme = {
        "name": "nvme",
        "kind": "lmdb",
        "path": str(tmp_path / "nvme"),
        "capacity": "1GiB",
        **tier_options,
    }
    return {"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}, nvme]}


@pytest.mark.parametrize("problem", ["readable by others", "missing", "a symlink"])
def test_config_check_refuses_a_secret_file_the_tier_would_refuse(capsys, tmp_path, problem):
    secret = tmp_path / "secret"
    if problem != "missing":
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o644 if problem == "readable by others" else 0o600)
    if problem == "a symlink":
        (tmp_path / "link").symlink_to(secret)
        secret = tmp_path / "link"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(write_config(tmp_path, secret_file=str(secret))))
    assert main(["config", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "invalid" in err and "tiers[1].secret_file" in err


@pytest.mark.parametrize("interval", [".inf", "1.0e+300"])
def test_a_stats_interval_no_thread_can_wait_is_refused(capsys, tmp_path, interval):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(write_config(tmp_path))
        + f"metrics: {{stats_file: {tmp_path / 's.json'}, stats_interval_s: {interval}}}\n"
    )
    assert main(["config", "check", str(path)]) == 1
    assert "metrics.stats_interval_s" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["valkey://[::1:6379", "valkey://[::1/0"])
def test_an_invalid_ipv6_url_is_a_config_error(capsys, tmp_path, url):
    section = {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": "1GiB"},
            {"name": "shared", "kind": "valkey", "url": url},
        ]
    }
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.url.*a server URL \(Invalid IPv6 URL\)"):
        load_config(section)
    assert main(["check", url]) != 0
    err = capsys.readouterr().err
    assert "Invalid IPv6 URL" in err and "Traceback" not in err


def test_a_password_on_the_command_line_is_warned_about_and_an_unused_server_refused(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["replay", "--valkey", "valkey://app:hunter2@127.0.0.1:1/0", "--limit", "2", "--no-progress"])
        == 2
    )
    err = capsys.readouterr().err
    assert "visible to every local user (ps)" in err and "password_file" in err
    assert "add --engines N" in err and "hunter2" not in err


def test_the_security_page_says_what_the_yaml_loader_does(tmp_path):
    """Aliases are accepted (they are worth having), with the expanded document capped."""
    config = load_config(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: &size 1GiB}\n"
        f"  - {{name: nvme, kind: lmdb, capacity: *size, path: {tmp_path / 'nvme'}}}\n"
    )
    assert config.tiers[1].capacity_bytes == config.tiers[0].capacity_bytes == 1 << 30
    page = (DOCS / "security.md").read_text()
    assert not re.search(r"aliases are refused", page, re.IGNORECASE)
    assert re.search(r"aliases are accepted", page, re.IGNORECASE) and "10,000" in page

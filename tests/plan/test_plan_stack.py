"""``kvtier plan``: sizes in one unit style at the model's block size, the advice written as a
stack that ``kvtier config check`` accepts and whose tiers hold the advised blocks, and the
progress bar on a terminal only."""

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios

import pytest

from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.tiers.cpu.backend import CPUBackend
from kvtier_testing.costs import TINY

TINY_BLOCK = 64 * 512  # TINY's 64 KV bytes/token x a trace block's 512 tokens
#: a size as text: a number and a unit, binary or decimal (not a rate: GB/s is one)
SIZE = re.compile(r"\b\d+(?:\.\d+)? ?(B|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB)\b(?!/s)")


@pytest.fixture
def trace(tmp_path):
    chains = [(1, 2, 3), (1, 2, 4), (1, 2, 3), (5, 6), (1, 7)]
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"timestamp": i * 100, "input_length": 1536, "output_length": 1, "hash_ids": list(c)})
            for i, c in enumerate(chains * 12)
        )
    )
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _plan(trace, *extra):
    return ["plan", trace, "--capacities", "2", "4", "8", "--policies", "lru", "arc", "--jobs", "1", *extra]


def test_model_sets_the_block_and_every_size_is_binary(trace, tiny, tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_per_hour: 3\ndram_per_gb_month: 3\nnvme_per_gb_month: 0.1\n")
    argv = _plan(trace, "--model", tiny, "--prices", str(prices), "--gpu-blocks", "2")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "blocks of 32 KiB: 512 tokens x 64 KV bytes/token" in text
    units = {match.group(1) for match in SIZE.finditer(text)}
    assert units and units <= {"B", "KiB", "MiB", "GiB", "TiB"}, units
    assert "header too" in text  # where a user sizes the disk tier
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["block_bytes"] == TINY_BLOCK == record["money"]["block_bytes"]
    advice = record["recommend"]
    assert advice["disk_bytes"] == advice["disk_blocks"] * TINY_BLOCK


def test_block_bytes_that_contradict_the_model_are_refused(trace, tiny, capsys):
    assert main(_plan(trace, "--model", tiny, "--block-bytes", "4096")) == 2
    assert "--block-bytes: got 4096; expected 32768 with --model" in capsys.readouterr().err
    assert main(_plan(trace, "--model", tiny, "--block-bytes", str(TINY_BLOCK), "--json")) == 0


def test_the_written_stack_passes_config_check_and_holds_the_advice(
    trace, tiny, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HOME", str(tmp_path))  # the written disk path is under ~
    written = tmp_path / "stack.yaml"
    assert main(_plan(trace, "--model", tiny, "--write-config", str(written), "--json")) == 0
    advice = json.loads(capsys.readouterr().out)["recommend"]
    assert os.stat(written).st_mode & 0o077 == 0  # the user's own file
    assert main(["config", "check", str(written)]) == 0
    capsys.readouterr()
    config = load_config(str(written))
    cpu, disk = config.tiers
    assert config.block_size_tokens == 512 and disk.path.startswith("~")
    # the disk tier's capacity holds the advised blocks, each block's header counted
    assert disk.blocks_held(TINY_BLOCK) == advice["disk_blocks"]
    assert disk.capacity_bytes == advice["disk_capacity_bytes"]
    # and the CPU tier, opened, has a row for each advised block
    backend = CPUBackend.from_config(cpu, TINY_BLOCK)
    try:
        assert backend.get_num_free_blocks() == advice["cpu_blocks"]
    finally:
        backend.shutdown()


def test_no_stack_is_written_when_a_target_is_not_reached(trace, tmp_path, capsys):
    written = tmp_path / "stack.yaml"
    argv = [
        "plan",
        trace,
        "--capacities",
        "1",
        "--policies",
        "lru",
        "--jobs",
        "1",
        "--write-config",
        str(written),
    ]
    assert main(argv) == 2
    assert "simulate larger sizes" in capsys.readouterr().err and not written.exists()
    # a folder that does not exist fails before any simulation
    assert main(_plan(trace, "--write-config", str(tmp_path / "no" / "stack.yaml"))) == 2
    assert "--write-config" in capsys.readouterr().err


def _on_a_terminal(argv):
    """Run kvtier with stderr on a pseudo-terminal; its stdout and what the terminal showed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", *argv], stdout=subprocess.PIPE, stderr=slave, text=True
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        shown += chunk
    out = process.communicate(timeout=120)[0]
    os.close(master)
    assert process.returncode == 0
    return out, shown.decode(errors="replace")


def test_progress_on_a_terminal_stderr_never_on_stdout(trace):
    out, shown = _on_a_terminal(_plan(trace, "--json"))
    assert "plan: 100%" in shown  # the bar counted every simulation
    (line,) = out.splitlines()
    assert json.loads(line)["bench"] == "plan"
    _, shown = _on_a_terminal(_plan(trace, "--json", "--no-progress"))
    assert "plan:" not in shown

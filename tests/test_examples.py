"""The runnable examples run, and say what they promise; every stack in examples/ replays."""

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvtier_testing.valkey_tier import local_server

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_restart_example_serves_every_block_after_a_restart(kind):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "restart_survives.py"), "--kind", kind, "--blocks", "80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "served 80/80 blocks byte for byte, 80 of them read back from disk" in result.stdout


# -- every stack in examples/ replays --------------------------------------------------------------

ROOT = EXAMPLES.parent
STACKS = sorted(path for path in EXAMPLES.rglob("*.yaml") if re.search(r"^tiers:", path.read_text(), re.M))
#: capacities a test can allocate: the CPU tier holds about 480 of replay's 16 KiB blocks, a
#: lower tier about 7,000, so the trace's first requests evict from the CPU tier and hit below
SCALED_CPU, SCALED_LOWER = "8MiB", "128MiB"


def _replay_line(path: Path) -> str:
    """The example's own word on how to replay it (its comment lines that say so)."""
    text = path.read_text()
    found = re.search(r"^# (?:Replay it|To replay)[^\n]*(?:\n#  [^\n]*)*", text, re.M)
    assert found, f"{path.relative_to(ROOT)} does not say how to replay it"
    return found.group(0)


def test_every_stack_example_is_here():
    names = {str(path.relative_to(EXAMPLES)) for path in STACKS}
    assert {"cpu-lmdb.yaml", "cpu-files.yaml", "cpu-nvme-valkey.yaml", "vllm/tiers.yaml"} <= names


@pytest.mark.parametrize("path", STACKS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_each_stack_example_says_how_to_replay_it(path):
    line = _replay_line(path)
    if yaml.safe_load(path.read_text())["tiers"][0]["kind"] == "cpu":
        assert f"kvtier replay --config {path.relative_to(ROOT)}" in line
    else:  # lower tiers only (SGLang's host pool stands first): the line says what to add
        assert "cpu tier" in line


def _scaled(path: Path, tmp_path: Path, server_url: str | None) -> Path:
    """The example with capacities a test can allocate, paths under ``tmp_path`` and the test's
    server as its Valkey; every other key as written. A stack of lower tiers alone gets the
    cpu tier its line says to add."""
    document = yaml.safe_load(path.read_text())
    tiers = document["tiers"]
    if tiers[0]["kind"] != "cpu":
        tiers.insert(0, {"name": "cpu", "kind": "cpu", "capacity": SCALED_CPU})
    for tier in tiers:
        if tier["kind"] == "cpu":
            tier["capacity"] = SCALED_CPU
        elif "capacity" in tier:
            tier["capacity"] = SCALED_LOWER
        if "path" in tier:
            tier["path"] = str(tmp_path / tier["name"])
        if tier["kind"] in ("valkey", "redis"):
            tier.pop("cluster_nodes", None)
            tier["url"] = server_url
    scaled = tmp_path / path.name
    scaled.write_text(yaml.safe_dump(document))
    return scaled


@pytest.mark.slow
@pytest.mark.parametrize("path", STACKS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_each_stack_example_replays_every_block_exact(path, tmp_path, capsys):
    from kvtier.cli.main import main

    names_server = re.search(r"kind: (?:valkey|redis)", path.read_text())
    with local_server() if names_server else contextlib.nullcontext() as server:
        scaled = _scaled(path, tmp_path, server and server.url)
        code = main(
            ["replay", "--config", str(scaled), "--limit", "300", "--gpu-blocks", "200"]
            + ["--deterministic", "--no-baseline", "--no-progress", "--json"]
        )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["mismatched_blocks"] == 0 and record["verified_blocks"] > 0
    tiers = yaml.safe_load(scaled.read_text())["tiers"]
    assert record["tiers"] == [f"{tier['name']}:{tier['kind']}" for tier in tiers]
    if len(tiers) > 1:  # the tiers below the CPU tier serve blocks too
        assert sum(record["hits"][tier["name"]] for tier in tiers[1:]) > 0, record["hits"]


def test_the_example_sized_for_replay_replays_as_written(capsys):
    from kvtier.cli.main import main

    command = _replay_line(EXAMPLES / "cpu-20000-blocks.yaml").split(": ", 1)[1].split()
    assert command[:3] == ["kvtier", "replay", "--config"]
    config = str(ROOT / command[3])
    assert main(["replay", "--config", config, "--limit", "200", "--no-progress", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["mismatched_blocks"] == 0 and record["tiers"] == ["cpu:cpu"]

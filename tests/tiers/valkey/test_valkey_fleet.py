"""``kvtier replay --engines N`` over a real server with the user's own local stack."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main

# engine processes, each importing torch
pytestmark = pytest.mark.slow


def fleet(capsys, *argv: str) -> dict:
    assert main(["replay", "--engines", "2", "--no-progress", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("with_disk", [False, True], ids=["cpu", "cpu+lmdb"])
def test_a_fleet_runs_the_users_own_local_stack(with_disk, valkey_server, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the engines' copies of the disk tier go in a temporary folder here
    store = tmp_path / "nvme"
    text = "tiers:\n  - {name: cpu, kind: cpu, capacity: 3MiB, eviction: arc}\n"
    if with_disk:
        text += f"  - {{name: nvme, kind: lmdb, path: {store}, capacity: 64MiB, fsync: none}}\n"
    (tmp_path / "local.yaml").write_text(text)
    record = fleet(
        capsys,
        "--config",
        "local.yaml",
        "--valkey",
        valkey_server.url,
        "--limit",
        "160",
        "--gpu-blocks",
        "400",
    )
    assert record["tiers"] == ["cpu:cpu", *(["nvme:lmdb"] if with_disk else []), "shared:valkey"]
    shared, local = record["shared"], record["local"]
    assert record["mismatched_blocks"] == 0 and shared["corrupt_blocks"] == local["corrupt_blocks"] == 0
    # what one engine computed came back to the other through the server, compared byte for byte
    assert shared["hits"]["shared"] > 0 and shared["verified_blocks"] >= shared["hits"]["shared"]
    if with_disk:  # each engine's copy of the user's disk tier served blocks of its own
        assert local["hits"]["nvme"] > 0 and local["verified_blocks"] >= local["hits"]["nvme"]
    assert not store.exists()  # never the user's store: each engine had its own
    assert [path.name for path in tmp_path.iterdir()] == ["local.yaml"]  # the copies are gone

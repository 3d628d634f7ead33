"""``kvtier replay --engines N`` over a real server: the user's own local stack, and the routers."""

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


def test_prefix_routing_keeps_prefixes_where_they_are_within_the_load_bound(
    valkey_server, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    common = ("--valkey", valkey_server.url, "--limit", "200", "--gpu-blocks", "400", "--no-baseline")
    dealt = fleet(capsys, *common)
    routed = fleet(capsys, *common, "--router", "prefix", "--model", "Llama-3.1-8B", "--gpu", "H100")
    assert dealt["router"] == "round_robin" and routed["router"] == "prefix"
    assert "local" not in routed and "local_hit_ratio" not in routed  # --no-baseline: shared run only
    assert dealt["shared"]["requests_per_engine"] == [100, 100]
    shared = routed["shared"]
    assert sum(shared["requests_per_engine"]) == 200 and shared["imbalance"] <= 1.2
    computed = [engine["computed_blocks"] for engine in shared["engines"]]
    assert shared["computed_imbalance"] == max(computed) / (sum(computed) / 2)
    # the engines' GPU caches served more of the prefixes once requests went where they were
    assert shared["hits"]["gpu"] > 1.2 * dealt["shared"]["hits"]["gpu"]
    assert shared["hit_ratios"]["gpu"] == shared["hits"]["gpu"] / routed["block_refs"]
    loaded = sum(hits for tier, hits in shared["hits"].items() if tier != "gpu")
    assert routed["mismatched_blocks"] == 0 and shared["verified_blocks"] == loaded > 0
    time = shared["time"]  # each engine a prefill queue over the requests it was sent
    assert 0 < time["ttft_p50_s"] <= time["ttft_p99_s"] and time["gpu_seconds"] > 0
    assert routed["time_model"]["model"]["name"] == "Llama-3.1-8B"

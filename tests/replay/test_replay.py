import io
import json

import numpy as np
import pytest

from kvtier.config import CascadeConfig, format_size
from kvtier.manager.stack import TierStackManager
from kvtier.policies.lru import LRUPolicy
from kvtier.replay.engine import ReplayEngine, block_bytes_of, block_key
from kvtier.replay.run import replay
from kvtier.replay.trace import Request, bundled_trace_path, load_trace
from kvtier.spec import TieredOffloadingSpec
from kvtier.testing import MemoryTier
from kvtier.tiers.cpu.backend import CPUBackend

BLOCK = 4096


def cpu_config(blocks: int) -> dict:
    return {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": blocks * BLOCK, "pin_memory": "off"}],
    }


def test_block_bytes_are_distinct_per_key():
    a, b = block_bytes_of(block_key(1), BLOCK), block_bytes_of(block_key(2), BLOCK)
    assert a.shape == (BLOCK,) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, block_bytes_of(block_key(1), BLOCK))


def test_cpu_only_replay_of_a_trace_slice_verifies_every_load(tmp_path, capsys):
    record = replay(
        str(bundled_trace_path()),
        json.dumps(cpu_config(3000)),
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=300,
        progress=False,
        json_line=True,
    )
    assert record["requests"] == 300 and record["mismatched_blocks"] == 0
    # the record's time accounting adds up (how long anything took is never asserted)
    assert 0 < record["engine_s"] < record["elapsed_s"]
    assert record["stack_s"] == record["elapsed_s"] - record["engine_s"]
    assert record["hits"]["cpu"] > 0 and record["verified_blocks"] == record["hits"]["cpu"]
    assert record["copies"]["load"]["bytes"] == record["verified_blocks"] * BLOCK
    assert record["copies"]["load"]["gbps"] > 0
    assert record["hit_ratio"] <= record["ceiling_hit_ratio"] + 1e-9
    # every reference is a hit of some tier or computed again
    assert sum(record["hits"].values()) + record["computed_blocks"] == record["block_refs"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(record))


def stack_engine(tmp_path, cpu_blocks: int, store_blocks: int, gpu_blocks: int):
    spec = TieredOffloadingSpec(
        {
            "block_size_tokens": 512,
            "tiers": [
                {
                    "kind": "cpu",
                    "capacity": cpu_blocks * BLOCK,
                    "path": str(tmp_path / "cpu-region"),
                    "pin_memory": "off",
                }
            ],
        },
        gpu_block_size_tokens=512,
        page_bytes=[BLOCK],
    )
    backend = CPUBackend(cpu_blocks, BLOCK, path=spec.region_path, pin_memory="off")
    store = MemoryTier("mem", backend.rows, store_blocks)
    spec._manager = TierStackManager(
        backend, LRUPolicy(cpu_blocks), [store], CascadeConfig(write_policy="write_through")
    )
    return ReplayEngine(spec, gpu_blocks), store


def test_stack_replay_promotes_from_below_and_serves_right_bytes(tmp_path):
    engine, store = stack_engine(tmp_path, cpu_blocks=8, store_blocks=100, gpu_blocks=4)
    shared = Request(0, 0, 0, (1, 2, 3, 4))
    others = [Request(i, 0, 0, tuple(range(10 * i, 10 * i + 4))) for i in range(1, 4)]
    requests = [shared, *others, shared]  # 12 other blocks push the shared ones out of the CPU tier
    try:
        engine.run(requests)
    finally:
        engine.close()
    counts = engine.counts
    assert counts.mismatched_blocks == 0
    assert counts.hits["mem"] > 0  # blocks 1-4 left the GPU and the CPU tier, came back from below
    assert counts.verified_blocks == counts.hits["cpu"] + counts.hits["mem"]
    assert counts.dropped_blocks == 0
    # the worker's copies, as its engine reported them: every stored block went out once,
    # every block served from below the GPU came in once
    assert counts.copies["store"]["bytes"] == counts.stored_blocks * BLOCK
    assert counts.copies["load"]["bytes"] == counts.verified_blocks * BLOCK
    assert all(counts.copies[d]["jobs"] > 0 and counts.copies[d]["seconds"] > 0 for d in counts.copies)


def test_stack_replay_with_rotting_store_is_a_miss_not_wrong_bytes(tmp_path):
    engine, store = stack_engine(tmp_path, cpu_blocks=4, store_blocks=100, gpu_blocks=4)
    first = [Request(i, 0, 0, tuple(range(4 * i + 1, 4 * i + 5))) for i in range(4)]
    try:
        engine.run(first)
        for hash_id in (1, 2, 3, 4):
            if store.lookup(block_key(hash_id)):
                store.corrupt(block_key(hash_id))
        engine.run([Request(3, 0, 0, (1, 2, 3, 4))])
    finally:
        engine.close()
    assert engine.counts.mismatched_blocks == 0
    assert engine.manager.stats()["mem.corrupt_blocks"] >= 1
    assert engine.counts.hits["mem"] == 0  # every rotten block was a miss, then recomputed


def test_replay_plot_draws_tiers_ceiling_and_cpu_only_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot

    def spy(self, *args, label=None, **kwargs):
        labels.append(label)
        return plot(self, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    target = tmp_path / "hits.png"
    replay(
        str(bundled_trace_path()),
        None,
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=100,
        progress=False,
        plot=str(target),
    )
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"all tiers", "ceiling (unbounded cache)", "CPU tier alone", "gpu", "cpu", "disk"} <= set(labels)


def test_ceiling_timeline_ends_at_the_ceiling():
    from kvtier.replay.run import _ceiling_timeline
    from kvtier.replay.trace import ceiling_hit_ratio

    requests = load_trace(bundled_trace_path(), 200)
    timeline = [(50, {}, 0), (120, {}, 0), (200, {}, 0)]
    curve = _ceiling_timeline(requests, timeline)
    assert curve[-1] == ceiling_hit_ratio(requests)[0]
    assert curve[0] == ceiling_hit_ratio(requests[:50])[0]


def test_requests_larger_than_the_gpu_cache_are_reported_and_skipped_before_the_replay(tmp_path, capsys):
    requests = load_trace(bundled_trace_path(), 200)
    gpu_blocks = sorted(len(r.hash_ids) for r in requests)[150]  # about a quarter do not fit
    too_big = [r for r in requests if len(r.hash_ids) > gpu_blocks]
    assert too_big
    record = replay(
        str(bundled_trace_path()),
        json.dumps(cpu_config(3000)),
        gpu_blocks=gpu_blocks,
        block_bytes=BLOCK,
        limit=200,
        progress=False,
    )
    err = capsys.readouterr().err
    assert f"skipping {len(too_big)} of 200 requests" in err and "raise --gpu-blocks" in err
    assert record["skipped_requests"] == len(too_big)
    assert record["skipped_block_refs"] == sum(len(r.hash_ids) for r in too_big)
    assert record["requests"] == 200 - len(too_big) and record["mismatched_blocks"] == 0


def test_a_gpu_cache_too_small_for_every_request_is_an_error_before_the_replay(tmp_path):
    from kvtier.errors import KvtierError

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": i, "input_length": 1, "output_length": 1, "hash_ids": list(range(i, i + 5 + i))}
            )
            + "\n"
            for i in range(3)
        )
    )
    with pytest.raises(KvtierError, match="raise --gpu-blocks to at least 7"):
        replay(str(trace), json.dumps(cpu_config(100)), gpu_blocks=4, progress=False)
    with pytest.raises(KvtierError, match="--gpu-blocks must be at least 1"):
        replay(str(trace), json.dumps(cpu_config(100)), gpu_blocks=0, progress=False)


def test_cli_replay_without_json_prints_the_table_and_no_json_line(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--limit", "60", "--no-progress", "--no-baseline", "--block-bytes", "4096"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("kvtier replay: 60 requests") and "ceiling" in lines[0]
    # the time says what it covers, and what it leaves out
    assert lines[1].startswith("replayed in ") and "not the trace load" in lines[1]
    assert lines[2].split() == ["tier", "hits", "hit_ratio", "bytes_read", "bytes_written"]
    assert not any(line.lstrip().startswith("{") for line in lines)


def test_cli_replay_default_stack_on_a_slice(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--limit", "150", "--no-progress", "--json", "--block-bytes", "4096"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tiers"] == ["cpu:cpu", "disk:lmdb"]
    assert record["mismatched_blocks"] == 0 and record["dropped_blocks"] == 0
    assert 0 < record["hit_ratio"] <= record["ceiling_hit_ratio"] + 1e-9
    assert "cpu_only_hit_ratio" in record


def test_the_default_stack_lives_in_the_user_cache_whatever_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    """Its throwaway store goes under XDG_CACHE_HOME (0700), not into the working directory,
    which may be read-only or not a folder of this user's; where the cache folder cannot be
    made, the error names it and the fix."""
    from kvtier.cli.main import main

    args = ["replay", "--limit", "30", "--no-progress", "--no-baseline", "--block-bytes", "4096", "--json"]
    monkeypatch.chdir("/proc")  # no folder can be made here
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["mismatched_blocks"] == 0
    root = tmp_path / "cache" / "kvtier"
    assert oct(root.stat().st_mode & 0o777) == "0o700" and list(root.iterdir()) == []  # removed
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/cache")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "XDG_CACHE_HOME: got '/proc/cache/kvtier'" in err and "give --config a stack" in err


def test_replay_reports_each_lower_tiers_admission(tmp_path):
    """`admit: reuse` on a small stack: the JSON says per tier what was admitted and refused,
    and its bytes written are the tier's bytes in the table."""
    import yaml

    from kvtier.replay.run import default_config

    config = default_config(str(tmp_path), BLOCK, "files")
    config["tiers"][0]["capacity"] = 300 * (BLOCK + 4096)  # a small CPU tier: blocks leave it
    config["tiers"][1].update(admit="reuse", min_reuse=2, endurance_tbw=600)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    out = io.StringIO()
    record = replay(
        config=str(path),
        limit=300,
        gpu_blocks=200,
        block_bytes=BLOCK,
        baseline=False,
        progress=False,
        out=out,
    )
    admission = record["admission"]["disk"]
    assert admission["refused_blocks"] > 0 and admission["admitted_blocks"] > 0
    assert admission["bytes_written"] == record["bytes_written"]["disk"] > 0
    assert admission["bytes_written"] == admission["admitted_blocks"] * BLOCK
    assert admission["projected_life_days"] > 0
    assert record["mismatched_blocks"] == 0
    # the text says what the JSON does: the checks, and what admission took and refused
    text = out.getvalue()
    assert (
        f"loads: {record['verified_blocks']} verified byte for byte, 0 served wrong bytes" in text
        and f"{record['corrupt_blocks']} corrupt" in text
        and f"{record['dropped_blocks']} blocks dropped" in text
    )
    assert (
        f"tier disk: admitted {admission['admitted_blocks']} blocks, refused {admission['refused_blocks']}; "
        f"wrote {format_size(admission['bytes_written'])}" in text
    )
    assert "hit ratio = block refs served by any tier, the GPU cache included / every block ref" in text


def test_a_warm_store_is_warned_about_and_fresh_empties_it(tmp_path, capsys):
    """A second replay over a persistent store counts the first one's blocks: it says so on
    stderr, and --fresh starts it clean (the ratio back under the trace's ceiling)."""
    import yaml

    from kvtier.cli.main import main
    from kvtier.replay.run import default_config

    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(default_config(str(tmp_path), BLOCK)))
    args = [
        "replay",
        "--config",
        str(path),
        "--limit",
        "150",
        "--no-progress",
        "--no-baseline",
        "--deterministic",
    ]
    runs = []
    for extra in ([], [], ["--fresh"]):
        assert main([*args, "--block-bytes", str(BLOCK), "--json", *extra]) == 0
        captured = capsys.readouterr()
        runs.append((json.loads(captured.out), captured.err))
    (first, cold), (second, warm), (fresh, emptied) = runs
    assert "already holds" not in cold and first["hit_ratio"] <= first["ceiling_hit_ratio"] + 1e-9
    assert second["hit_ratio"] > second["ceiling_hit_ratio"]  # the earlier run's blocks hit
    assert "warning: tier disk" in warm and "already holds" in warm and "--fresh" in warm
    assert "--fresh: emptied the store at" in emptied and "already holds" not in emptied
    assert fresh["hits"] == first["hits"]


def test_fresh_never_empties_a_directory_kvtier_did_not_write(tmp_path, capsys):
    from kvtier.cli.main import main

    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "precious").write_text("kept")
    path = tmp_path / "stack.yaml"
    path.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 4MiB, pin_memory: off}\n"
        f"  - {{name: disk, kind: lmdb, path: {store}, capacity: 64MiB}}\n"
    )
    assert main(["replay", "--config", str(path), "--limit", "10", "--no-progress", "--fresh"]) == 2
    assert "kvtier never deletes files it did not write" in capsys.readouterr().err
    assert (store / "precious").read_text() == "kept"


@pytest.mark.slow
def test_deterministic_replays_repeat_every_figure_but_the_times(tmp_path):
    """A small CPU tier over a disk tier: blocks are saved, evicted and promoted all along.
    Two deterministic runs agree on everything the stack did, hits per tier included."""
    import yaml

    from kvtier.replay.run import default_config

    records = []
    for run in range(2):
        (tmp_path / f"run{run}").mkdir()
        config = default_config(str(tmp_path / f"run{run}"), BLOCK)
        # room for the largest request's store (264 blocks) beside blocks that hit again: with
        # 300 rows, placing those stores (write_back makes room for them) leaves none to hit
        config["tiers"][0]["capacity"] = 400 * BLOCK
        path = tmp_path / f"stack{run}.yaml"
        path.write_text(yaml.safe_dump(config))
        records.append(
            replay(
                config=str(path),
                limit=600,
                gpu_blocks=200,
                block_bytes=BLOCK,
                baseline=False,
                progress=False,
                deterministic=True,
            )
        )
    first, second = records
    assert first["deterministic"] and first["promotions"] > 0 and first["hits"]["cpu"] > 0
    assert first["mismatched_blocks"] == 0
    for name in (
        "hits",
        "bytes_read",
        "bytes_written",
        "promotions",
        "demotions",
        "steps",
        "stored_blocks",
        "computed_blocks",
        "verified_blocks",
        "store_waits",
    ):
        assert first[name] == second[name], name


def test_cli_refuses_a_deterministic_fleet(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--engines", "2", "--deterministic", "--no-progress"]) == 2
    assert "--deterministic is for one engine" in capsys.readouterr().err


def test_cli_refuses_a_fleet_on_cuda(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--engines", "2", "--device", "cuda", "--no-progress"]) == 2
    assert "--engines runs each engine's cache as CPU tensors" in capsys.readouterr().err


def test_cli_refuses_a_router_without_a_fleet(capsys):
    from kvtier.cli.main import main

    assert main(["replay", "--router", "prefix", "--no-progress"]) == 2
    assert "--router routes a fleet's requests: add --engines N" in capsys.readouterr().err


def test_a_stop_signal_waits_for_the_request_in_hand(tmp_path):
    """kvtier's commands turn SIGTERM into an exception; one raised in the middle of a request
    could leave a job counted and never queued, and the shutdown after it waiting for ever
    (seen: a replay that SIGHUP left spinning). It comes as the request ends instead."""
    import os
    import signal

    from kvtier.cli.signals import Stopped, stop_on_signals

    engine, store = stack_engine(tmp_path, cpu_blocks=8, store_blocks=100, gpu_blocks=4)
    serve, served = engine.run_request, []

    def run_request(index, request):
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (the main) thread
        serve(index, request)
        served.append(index)

    engine.run_request = run_request
    requests = [Request(i, 0, 0, tuple(range(10 * i, 10 * i + 4))) for i in range(4)]
    try:
        with stop_on_signals(), pytest.raises(Stopped):
            engine.run(requests)
        assert served == [0, 1]  # the request in hand was served whole; none after it
    finally:
        engine.close()
    assert engine.counts.stored_blocks == 8 and engine.counts.mismatched_blocks == 0

"""``kvtier replay`` shows the stack's misses by cause: its JSON, its text table, its plot."""

from __future__ import annotations

import json

import pytest
import yaml

from kvtier.manager.causes import CAUSES
from kvtier.replay.run import default_config, replay
from kvtier.replay.trace import bundled_trace_path

BLOCK = 4096


def write_trace(path, chains) -> str:
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": list(c)}
            )
            + "\n"
            for i, c in enumerate(chains)
        )
    )
    return str(path)


def test_a_request_coming_back_after_its_blocks_left_misses_as_evicted(tmp_path, capsys):
    """Four requests of 4 new blocks each, then the first again: a 4-block GPU cache and an
    8-block CPU tier have let its blocks go. Every block is a miss with its cause, those behind
    a request's first miss (never looked up) too: sixteen new, then four evicted by the CPU
    tier."""
    chains = [tuple(range(10 * i, 10 * i + 4)) for i in range(4)]
    trace = write_trace(tmp_path / "trace.jsonl", [*chains, chains[0]])
    config = {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": 8 * BLOCK, "pin_memory": "off"}],
    }
    record = replay(
        trace, json.dumps(config), gpu_blocks=4, block_bytes=BLOCK, progress=False, json_line=True
    )
    causes = record["miss_causes"]
    assert causes["misses"] == 20 == record["block_refs"] - sum(record["hits"].values())
    assert causes["causes"] == {**dict.fromkeys(CAUSES, 0), "new": 16, "evicted": 4}
    assert causes["by_tier"] == {"cpu": {"evicted": 4}}
    assert causes["sketch"]["bytes"] <= 16 * causes["sketch"]["keys"]
    out = capsys.readouterr().out
    assert "misses by cause" in out
    table = out[out.index("misses by cause") :].splitlines()
    assert table[1].split() == ["cause", "misses", "share", "where"]
    assert any(line.split()[:2] == ["evicted", "4"] and "cpu 4" in line for line in table)
    assert json.loads(out.strip().splitlines()[-1])["miss_causes"] == causes


def test_blocks_behind_a_miss_count_as_behind_where_a_tier_held_them(tmp_path):
    """A request of 3 new blocks, then one that starts with a new block and goes on with the
    first's last two: its lookups stop at the new block, and the two behind it, which the CPU
    tier holds, are misses ``behind`` (every block the replay computed has a cause)."""
    trace = write_trace(tmp_path / "trace.jsonl", [(1, 2, 3), (9, 2, 3)])
    config = {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": 8 * BLOCK, "pin_memory": "off"}],
    }
    record = replay(trace, json.dumps(config), gpu_blocks=8, block_bytes=BLOCK, progress=False)
    causes = record["miss_causes"]
    assert causes["causes"] == {**dict.fromkeys(CAUSES, 0), "new": 4, "behind": 2}
    assert causes["by_tier"] == {"cpu": {"behind": 2}}
    assert causes["misses"] == 6 == record["block_refs"] - sum(record["hits"].values())


@pytest.mark.slow
def test_on_the_bundled_trace_the_causes_add_up_to_every_missed_block(tmp_path):
    """The default stack, with a CPU tier small enough to let blocks go, over the bundled
    trace: the causes sum to the blocks no tier served, not to one miss a request."""
    config = default_config(str(tmp_path), BLOCK, "lmdb")
    config["tiers"][0]["capacity"] = 300 * (BLOCK + 4096)
    config["tiers"][1]["capacity"] = 2000 * (BLOCK + 4096)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    record = replay(
        config=str(path), limit=1500, gpu_blocks=200, block_bytes=BLOCK, baseline=False, progress=False
    )
    causes = record["miss_causes"]
    missed = record["block_refs"] - sum(record["hits"].values())
    assert sum(causes["causes"].values()) == causes["misses"] == missed
    assert causes["causes"]["evicted"] > 0


def test_a_stack_with_admission_shows_refused_misses(tmp_path):
    """A small CPU tier over a disk that admits a block on its second sighting: blocks seen
    once and let go by the CPU tier miss as refused by the disk, not as evicted."""
    config = default_config(str(tmp_path), BLOCK, "files")
    config["tiers"][0]["capacity"] = 300 * (BLOCK + 4096)
    config["tiers"][1].update(admit="reuse", min_reuse=2)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    record = replay(
        config=str(path), limit=300, gpu_blocks=200, block_bytes=BLOCK, baseline=False, progress=False
    )
    causes = record["miss_causes"]
    assert sum(causes["causes"].values()) == causes["misses"] > 0
    assert causes["causes"]["new"] > 0
    assert (
        causes["causes"]["refused"] > 0
        and causes["by_tier"]["disk"]["refused"] == causes["causes"]["refused"]
    )
    assert record["mismatched_blocks"] == 0


def test_replay_without_causes_has_no_cause_record(tmp_path, capsys):
    config = {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": 64 * BLOCK, "pin_memory": "off"}],
        "miss_causes": "off",
    }
    record = replay(
        str(bundled_trace_path()),
        json.dumps(config),
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=20,
        progress=False,
    )
    assert "miss_causes" not in record
    assert "misses by cause" not in capsys.readouterr().out


def test_replay_plot_stacks_the_misses_by_cause(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    stacked: list[list[str]] = []
    stackplot = matplotlib.axes.Axes.stackplot

    def spy(self, x, *args, labels=(), **kwargs):
        stacked.append(list(labels))
        return stackplot(self, x, *args, labels=labels, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "stackplot", spy)
    target = tmp_path / "hits.png"
    record = replay(
        str(bundled_trace_path()),
        None,
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=100,
        progress=False,
        baseline=False,
        plot=str(target),
    )
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shown = [cause for cause, n in record["miss_causes"]["causes"].items() if n]
    assert stacked == [shown] and "new" in shown

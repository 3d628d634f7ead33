"""``kvtier bench cascade``: three stacks over one trace slice, the mirror as the baseline."""

import io
import json

import pytest

from kvtier.bench import cascade
from kvtier.cli.main import main


@pytest.mark.slow
def test_every_stack_writes_each_block_once_and_serves_the_same_hits():
    out = io.StringIO()
    record = cascade.run(limit=300, out=out)
    stacks = record["stacks"]
    assert list(stacks) == list(cascade.STACKS) and record["baseline"] == "mirror"
    mirror = stacks["mirror"]
    assert mirror["total_bytes_written"] > 0
    for name, figures in stacks.items():
        assert figures["mismatched_blocks"] == 0
        assert 0 < figures["hit_ratio"] <= record["ceiling_hit_ratio"] + 1e-9
        # the disks hold the slice's working set: every distinct block is written once below,
        # by the run or by the shutdown's save, whichever way the tiers receive it
        assert figures["total_bytes_written"] == mirror["total_bytes_written"], name
        assert figures["total_vs_mirror"] == 1.0
        in_run = sum(figures["bytes_written"].values())
        assert figures["total_bytes_written"] == in_run + sum(figures["shutdown_bytes_written"].values())
    split = stacks["nvme+bulk"]
    assert set(split["bytes_written"]) == {"nvme", "bulk"}
    # the mirror admits reused blocks only; the victim tier takes what it did not keep
    assert split["admission"]["nvme"]["refused_blocks"] > 0
    assert not any(line.startswith("{") for line in out.getvalue().splitlines())  # JSON: the CLI's --json


def test_cli_json_line(capsys):
    assert main(["bench", "cascade", "--limit", "50", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # the JSON line and nothing else
    record = json.loads(line)
    assert record["bench"] == "cascade" and record["requests"] == 50

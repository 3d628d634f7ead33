"""`kvtier check PATH` and `kvtier bench disk` from the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier_testing import key
from kvtier_testing.store import KINDS, open_tier, region, store

from kvtier.cli.main import main
from kvtier.tiers.disk.format import HEADER_BYTES
from kvtier.tiers.disk.manifest import MANIFEST_NAME


@pytest.fixture
def shm():
    r = region(16)
    yield r
    r.close()


def make_store(kind, path, rows, count=4):
    tier = open_tier(kind, path, rows, 8)
    store(tier, rows, [key(i) for i in range(count)])
    tier.close()


def damage(kind, path):
    """Flip one payload byte of one block, found on disk without the tier."""
    if kind == "files":
        target = next(Path(path, "blocks").rglob("*.kvb"))
        offset = HEADER_BYTES + 10
    else:
        target = Path(path, "slab.kvs")
        offset = HEADER_BYTES + 10  # slot 0
    with open(target, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("kind", KINDS)
def test_check_reports_and_fixes_with_fscks_exit_statuses(kind, tmp_path, shm, capsys):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    assert main(["check", str(path)]) == 0  # clean
    assert "4 blocks checked, healthy" in capsys.readouterr().out

    damage(kind, path)
    assert main(["check", str(path)]) == 4  # problems left: found, not fixed
    out = capsys.readouterr().out
    assert "1 problems" in out and "checksum" in out

    assert main(["check", "--json", str(path)]) == 4
    record = json.loads(capsys.readouterr().out)
    assert record["healthy"] is False and record["blocks_checked"] == 4
    assert len(record["problems"]) == 1 and "checksum" in record["problems"][0]
    assert record["problems_left"] == record["problems"]

    assert main(["check", "--fix", str(path)]) == 1  # problems fixed, every one
    out = capsys.readouterr().out
    assert "fixed:" in out and "after --fix: healthy" in out
    assert main(["check", str(path)]) == 0
    assert "3 blocks checked, healthy" in capsys.readouterr().out


def test_check_after_a_fix_that_cannot_mend_the_store_exits_4(tmp_path, shm, capsys):
    # a manifest naming the other kind: --fix opens nothing, so the problem is left
    path = tmp_path / "store"
    make_store("lmdb", path, shm.rows)
    manifest = path / MANIFEST_NAME
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "kind": "files"}))
    assert main(["check", "--fix", "--json", str(path)]) == 4
    record = json.loads(capsys.readouterr().out)
    assert record["fixed"] == [] and len(record["problems_left"]) == 1
    assert "holds the files of a lmdb store" in record["problems_left"][0]


def test_check_of_a_non_store_could_not_check(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 8
    assert "kvtier-store.json" in capsys.readouterr().err
    assert main(["check", "--json", str(tmp_path / "missing")]) == 8
    assert json.loads(capsys.readouterr().out)["healthy"] is False
    assert main(["check", "--namespace", "ns", str(tmp_path)]) == 2  # a bad command line


def test_check_from_the_installed_command(tmp_path, shm):
    path = tmp_path / "store"
    make_store("lmdb", path, shm.rows)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kvtier"), "check", "--json", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["healthy"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_bench_disk_prints_every_figure(kind, tmp_path, capsys):
    code = main(
        [
            "bench",
            "disk",
            "--backend",
            kind,
            "--json",
            "--gib",
            "0.03125",
            "--rounds",
            "1",
            "--open-blocks",
            "300",
            "--dir",
            str(tmp_path),
            "--threads",
            "2",
            "--no-drop-caches",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "disk" and record["backend"] == kind and record["threads"] == 2
    for figure in ("write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps"):
        assert record[figure] > 0
    (sample,) = record["samples"]  # one round: the ratios are that round's
    assert record["write_ratio"] == pytest.approx(sample["write_gbps"] / sample["baseline_write_gbps"])
    assert record["read_ratio"] == pytest.approx(sample["read_gbps"] / sample["baseline_read_gbps"])
    assert record["open_blocks"] == 300 and record["open_s"] > 0
    assert record["cold_read_method"] in ("o_direct", "fadvise")
    assert record["open_cold_s"] is None  # not measured without dropping caches
    assert os.listdir(tmp_path) == []  # the benchmark removes its stores


def test_bench_disk_fails_cleanly_where_it_cannot_run(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "disk",
                "--backend",
                "files",
                "--gib",
                "0.03125",
                "--rounds",
                "1",
                "--open-blocks",
                "0",
                "--dir",
                str(tmp_path / "no" / "such"),
                "--no-drop-caches",
            ]
        )
        == 1
    )
    assert "kvtier bench disk:" in capsys.readouterr().err

"""A damaged LMDB index, and `kvtier check` that writes nothing without --fix.

A truncated ``data.mdb`` used to kill the process with SIGBUS when LMDB mapped it, so every
engine open, ``kvtier check`` and ``check --fix`` here runs in a subprocess: a crash is a
negative return code, not a dead pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier_testing import key
from kvtier_testing.store import KINDS, holds, load, open_tier, store

from kvtier.tiers.disk.manifest import MANIFEST_NAME
from kvtier.tiers.disk.scan import find_blocks

PAGE = 4096
BLOCKS = 12
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

# An engine opening the store: the tier of the store's own manifest, over one CPU row.
ENGINE = """
import sys
import numpy as np
from kvtier.errors import KvtierError
from kvtier.tiers.disk import open_store
from kvtier.tiers.disk.blockio import aligned_buffer
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.format import padded_payload_bytes
from kvtier.tiers.disk.manifest import read_manifest
path = sys.argv[1]
manifest = read_manifest(path)
size = manifest.block_bytes
rows = np.frombuffer(aligned_buffer(padded_payload_bytes(size)), dtype=np.uint8)[:size].reshape(1, size)
config = DiskTierConfig(name="disk", kind=manifest.kind, capacity_bytes=manifest.capacity_bytes, path=path)
try:
    tier = open_store(config, rows, manifest.fingerprint, threads=1)
except KvtierError as exc:
    print(f"refused: {exc}")
    sys.exit(3)
print(f"opened with {len(tier._policy)} blocks")
tier.close()
"""
CLI = "import sys; from kvtier.cli.main import main; sys.exit(main(sys.argv[1:]))"


def engine_open(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENGINE, str(path)],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def kvtier(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def alive(result: subprocess.CompletedProcess) -> None:
    """The process ended on its own: no SIGBUS, no other signal."""
    assert result.returncode >= 0, (
        f"killed by {signal.Signals(-result.returncode).name}: {result.stdout}{result.stderr}"
    )


def snapshot(path) -> dict[str, tuple]:
    """Every entry under ``path``: its type and mode, and for files size, mtime and content hash."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            info = os.lstat(full)
            record = (info.st_mode, info.st_mtime_ns)
            if name in files:
                record += (info.st_size, hashlib.sha256(Path(full).read_bytes()).hexdigest())
            found[os.path.relpath(full, path)] = record
    info = os.lstat(path)
    found["."] = (info.st_mode, info.st_mtime_ns)
    return found


def make_store(kind, path, rows, count=BLOCKS):
    tier = open_tier(kind, path, rows, 16)
    result = store(tier, rows, [key(i) for i in range(count)])
    assert len(result.ok) == count
    tier.close()


def truncate_empty(data: Path) -> None:
    os.truncate(data, 0)


def truncate_one_page(data: Path) -> None:
    os.truncate(data, PAGE)


def truncate_mid_file(data: Path) -> None:
    size = data.stat().st_size
    assert size >= 4 * PAGE, size  # two meta pages and more: the cut leaves both metas whole
    os.truncate(data, (size // 2) // PAGE * PAGE)


def garbage_meta(data: Path) -> None:
    with open(data, "r+b") as stream:
        stream.write(os.urandom(PAGE))


DAMAGE = [truncate_empty, truncate_one_page, truncate_mid_file, garbage_meta]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_index_is_found_before_mapping_and_rebuilt_by_fix(damage, tmp_path, shm):
    path = tmp_path / "store"
    make_store("lmdb", path, shm.rows)
    # one block damaged in the slab as well: the rebuild must not index it
    bad_file, bad_offset, bad_key = next(
        (f, o, k) for f, o, k in find_blocks(str(path), shm.rows.shape[1]) if k == key(3)
    )
    with open(bad_file, "r+b") as stream:
        stream.seek(bad_offset + PAGE + 100)
        stream.write(b"\xff\x00\xff")
    damage(path / "index" / "data.mdb")

    opened = engine_open(path)
    alive(opened)
    assert opened.returncode == 3, opened.stdout + opened.stderr
    assert "index damaged" in opened.stdout and f"kvtier check {path} --fix" in opened.stdout

    before = snapshot(path)
    checked = kvtier("check", path)
    alive(checked)
    assert checked.returncode == 4, checked.stdout + checked.stderr  # fsck's "problems left"
    assert "index damaged" in checked.stdout
    assert f"the slab holds {BLOCKS - 1} intact blocks" in checked.stdout
    assert snapshot(path) == before  # check without --fix wrote nothing

    as_json = kvtier("check", "--json", path)
    alive(as_json)
    record = json.loads(as_json.stdout)
    assert record["healthy"] is False and "index damaged" in record["problems"][0]

    fixed = kvtier("check", "--fix", path)
    alive(fixed)
    assert fixed.returncode == 1, fixed.stdout + fixed.stderr  # fsck's "problems fixed"
    assert "after --fix: healthy" in fixed.stdout
    assert f"rebuilt the index from the slab's block headers: {BLOCKS - 1} blocks re-indexed" in fixed.stdout

    again = kvtier("check", path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{BLOCKS - 1} blocks checked, healthy" in again.stdout
    opened = engine_open(path)
    assert opened.returncode == 0 and f"opened with {BLOCKS - 1} blocks" in opened.stdout, opened.stdout

    # every block that was intact is served byte for byte; the damaged one is not
    tier = open_tier("lmdb", path, shm.rows, 16)
    intact = [key(i) for i in range(BLOCKS) if i != 3]
    result = load(tier, shm.rows, intact)
    assert result.ok == intact
    assert all(holds(shm.rows, row, k) for row, k in enumerate(intact))
    assert load(tier, shm.rows, [bad_key]).ok == []
    # the rebuilt index hands out free slots without overwriting live blocks
    more = [key(100 + i) for i in range(4)]
    assert store(tier, shm.rows, more).ok == more
    assert load(tier, shm.rows, intact + more).ok == intact + more
    tier.close()


def test_an_empty_slab_rebuilds_an_empty_index(tmp_path, shm):
    path = tmp_path / "store"
    make_store("lmdb", path, shm.rows, count=0)
    garbage_meta(path / "index" / "data.mdb")
    fixed = kvtier("check", "--fix", path)
    alive(fixed)
    assert "0 blocks re-indexed" in fixed.stdout, fixed.stdout + fixed.stderr
    assert engine_open(path).returncode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_check_without_fix_writes_nothing(kind, tmp_path, shm):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    before = snapshot(path)
    result = kvtier("check", path)
    assert result.returncode == 0 and f"{BLOCKS} blocks checked, healthy" in result.stdout, result.stdout
    assert snapshot(path) == before
    # a store with a bad block: reported, still nothing written
    bad_file, bad_offset, _ = next(iter(find_blocks(str(path), shm.rows.shape[1])))
    with open(bad_file, "r+b") as stream:
        stream.seek(bad_offset + PAGE + 7)
        stream.write(b"\x01\x02")
    before = snapshot(path)
    result = kvtier("check", path)
    assert result.returncode == 4 and "checksum" in result.stdout, result.stdout + result.stderr
    assert snapshot(path) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fix", [False, True], ids=["check", "fix"])
def test_a_manifest_naming_the_other_kind_is_a_problem_and_nothing_is_written(kind, fix, tmp_path, shm):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    other = "files" if kind == "lmdb" else "lmdb"
    manifest = path / MANIFEST_NAME
    record = json.loads(manifest.read_text())
    record["kind"] = other
    manifest.write_text(json.dumps(record))
    before = snapshot(path)
    result = kvtier("check", *(["--fix"] if fix else []), path)
    alive(result)
    assert result.returncode == 4, result.stdout + result.stderr  # --fix cannot mend it either
    assert (
        f"the manifest names a {other} store, but the directory holds the files of a {kind} store"
        in result.stdout
    )
    assert "healthy" not in result.stdout
    assert snapshot(path) == before

"""Local stores no other user can read, plant or redirect (issue #22, item 1).

The attacker is a throwaway unprivileged user made for the test (``useradd``) and removed
after it; its actions run in a subprocess that drops to its uid and gid. A store "planted" by
it is built by root and handed to it with ``chown -R`` (the bytes an attacker could write are
the same). Tests that need a second user skip when not run as root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kvtier_testing import key
from kvtier_testing.users import throwaway_user
from kvtier_testing.store import KINDS, config, fingerprint, holds, load, open_tier, store

from kvtier.config import load_config
from kvtier.errors import ConfigError, DiskTierError, KvtierError
from kvtier.tiers.disk import check_store, open_store

root_only = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd"
)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
CLI = "import sys; from kvtier.cli.main import main; sys.exit(main(sys.argv[1:]))"
# another process of the same user holding the store's maintenance lock
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""
VICTIM_BYTES = b"root-only secret: 56 bytes of something that must stay.\n"


@pytest.fixture
def attacker():
    """A throwaway unprivileged user: ``(name, uid, gid)``; removed after the test."""
    with throwaway_user("kvtatk", "-U") as entry:
        yield entry.pw_name, entry.pw_uid, entry.pw_gid


@pytest.fixture
def shared():
    """A directory every user may write, with the sticky bit: what /var/tmp is."""
    path = tempfile.mkdtemp(prefix="kvtier-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def as_user(user, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run the shell ``command`` as ``user`` (uid and gid dropped, no supplementary groups)."""
    _, uid, gid = user

    def drop() -> None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)

    return subprocess.run(
        ["/bin/sh", "-c", command],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        check=False,
    )


def kvtier(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def make_store(kind, path, rows, count=4):
    tier = open_tier(kind, path, rows, 8)
    assert len(store(tier, rows, [key(i) for i in range(count)]).ok) == count
    tier.close()


def plant_store(kind, path, rows, user):
    """A valid store at ``path``, owned by ``user`` (as if it had written it)."""
    make_store(kind, path, rows)
    _, uid, gid = user
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(path)], check=True)


def victim_file(tmp_path) -> Path:
    victim = tmp_path / "root-only.txt"
    victim.write_bytes(VICTIM_BYTES)
    victim.chmod(0o600)
    return victim


def modes(path) -> dict[str, int]:
    found = {".": stat.S_IMODE(os.lstat(path).st_mode)}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            found[os.path.relpath(full, path)] = os.lstat(full).st_mode
    return found


# -- squatted paths -----------------------------------------------------------------------------


@root_only
@pytest.mark.parametrize("kind", KINDS)
def test_a_directory_another_user_created_first_is_refused(kind, shared, attacker, shm):
    squat = shared / f"kvtier-{kind}"
    made = as_user(attacker, f"mkdir -m 755 {squat}")
    assert made.returncode == 0, made.stderr
    with pytest.raises(ConfigError) as caught:
        open_tier(kind, squat, shm.rows, 8)
    message = str(caught.value)
    assert f"owned by uid {attacker[1]} ({attacker[0]})" in message and "Fix:" in message
    assert "~" not in message and ".cache/kvtier" in message  # the per-user way out
    assert os.listdir(squat) == []  # nothing of ours written where the attacker can read it


@root_only
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_another_user_planted_are_never_served(kind, shared, attacker, shm):
    squat = shared / f"kvtier-{kind}"
    plant_store(kind, squat, shm.rows, attacker)
    with pytest.raises(ConfigError, match=f"owned by uid {attacker[1]}"):
        open_tier(kind, squat, shm.rows, 8)
    checked = kvtier("check", squat)
    assert checked.returncode == 4, checked.stdout + checked.stderr
    assert f"owned by uid {attacker[1]}" in checked.stdout and "healthy" not in checked.stdout


@root_only
@pytest.mark.parametrize(
    ("kind", "name"),
    [("lmdb", "slab.kvs"), ("lmdb", "kvtier-store.lock"), ("files", "kvtier-users.lock"), ("files", "usage")],
)
def test_a_squatted_store_cannot_redirect_writes_through_a_symlink(
    kind, name, shared, attacker, tmp_path, shm
):
    """The attacker's directory holds a symlink to a root-only file (or to where a new file
    would appear): kvtier neither grows nor creates anything through it."""
    victim = victim_file(tmp_path)
    absent = tmp_path / "created-by-root"
    squat = shared / "kvtier-squat"
    target = victim if name in ("slab.kvs", "usage") else absent
    made = as_user(attacker, f"mkdir -m 755 {squat} && ln -s {target} {squat}/{name}")
    assert made.returncode == 0, made.stderr
    with pytest.raises(ConfigError, match="owned by uid"):
        open_tier(kind, squat, shm.rows, 8)
    assert victim.read_bytes() == VICTIM_BYTES
    assert not absent.exists()


@root_only
def test_a_squatted_store_cannot_make_kvtier_delete_through_a_symlinked_blocks_dir(
    shared, attacker, tmp_path, shm
):
    victims = tmp_path / "victims"
    (victims / "00").mkdir(parents=True)
    precious = victims / "00" / ".x.999999999.1.tmp"  # what a temp-file sweep would remove
    precious.write_bytes(VICTIM_BYTES)
    squat = shared / "kvtier-files"
    made = as_user(attacker, f"mkdir -m 755 {squat} && ln -s {victims} {squat}/blocks")
    assert made.returncode == 0, made.stderr
    with pytest.raises(ConfigError, match="owned by uid"):
        open_tier("files", squat, shm.rows, 8)
    assert precious.read_bytes() == VICTIM_BYTES


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("lmdb", "slab.kvs"),
        ("lmdb", "index"),
        ("lmdb", "index/data.mdb"),
        ("lmdb", "kvtier-store.lock"),
        ("lmdb", "kvtier-users.lock"),
        ("lmdb", "kvtier-store.json"),
        ("files", "usage"),
        ("files", "recency.log"),
        ("files", "blocks"),
        ("files", "blocks/00"),
    ],
)
def test_no_file_inside_a_store_is_followed_through_a_symlink(kind, name, tmp_path, shm):
    """Even in the user's own store, a symlink in place of any of its entries is refused,
    and what it points at is neither read, grown, created nor deleted."""
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    victim = victim_file(tmp_path)
    victims = tmp_path / "victims"
    victims.mkdir()
    (victims / "keep").write_bytes(VICTIM_BYTES)
    entry = path / name
    is_dir = entry.is_dir()
    shutil.rmtree(entry) if is_dir else entry.unlink()
    entry.symlink_to(victims if is_dir else victim)
    with pytest.raises(KvtierError):
        tier = open_tier(kind, path, shm.rows, 8)
        # a tier that opened must not serve or sweep anything through the link
        assert load(tier, shm.rows, [key(0)]).ok == []
        tier.close()
    assert victim.read_bytes() == VICTIM_BYTES
    assert sorted(os.listdir(victims)) == ["keep"] and (victims / "keep").read_bytes() == VICTIM_BYTES
    checked = check_store(str(path))
    assert not checked.healthy and any("symlink" in p for p in checked.problems), checked.problems


# -- permissions -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_directories_are_0700_and_files_0600_whatever_the_umask(kind, tmp_path, shm):
    path = tmp_path / "store"
    old = os.umask(0)
    try:
        make_store(kind, path, shm.rows)
        tier = open_tier(kind, path, shm.rows, 8)  # reopened: recency log, locks, usage in use
        assert load(tier, shm.rows, [key(1)]).ok == [key(1)]
        tier.close()
    finally:
        os.umask(old)
    found = modes(path)
    assert found.pop(".") == 0o700
    assert len(found) > 5
    for name, mode in found.items():
        wanted = (stat.S_IFDIR | 0o700) if stat.S_ISDIR(mode) else (stat.S_IFREG | 0o600)
        assert mode == wanted, f"{name}: {mode:o}"


@pytest.mark.parametrize("kind", KINDS)
def test_an_older_store_others_could_read_is_made_private_at_open(kind, tmp_path, shm):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    report = check_store(str(path))
    assert not report.healthy and any("mode 755" in p for p in report.problems), report.problems
    tier = open_tier(kind, path, shm.rows, 8)
    assert load(tier, shm.rows, [key(2)]).ok == [key(2)] and holds(shm.rows, 0, key(2))
    tier.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert check_store(str(path)).healthy


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_directory_others_may_write_is_refused_and_reported(kind, tmp_path, shm):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    os.chmod(path, 0o777)
    with pytest.raises(ConfigError, match=r"mode 777: group or others may write in it.*Fix: chmod 700"):
        open_tier(kind, path, shm.rows, 8)
    report = check_store(str(path), fix=True)  # --fix does not take such a store over either
    assert any("mode 777" in p for p in report.problems) and not report.fixed
    os.chmod(path, 0o700)
    assert check_store(str(path)).healthy


def test_a_store_is_not_created_in_a_directory_anyone_may_rewrite(tmp_path, shm):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # no sticky bit: anyone could rename the store away and replace it
    with pytest.raises(ConfigError, match="writable by everyone without the sticky bit"):
        open_tier("lmdb", parent / "store", shm.rows, 8)


def test_the_per_user_default_root_is_created_private(tmp_path, monkeypatch, shm):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "kvtier"
    tier = open_tier("lmdb", root / "disk", shm.rows, 8)
    tier.close()
    for made in (tmp_path / "cache", root, root / "disk"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match="create .* first"):  # elsewhere only the last component
        open_tier("lmdb", tmp_path / "a" / "b", shm.rows, 8)


def test_no_example_and_no_error_suggests_a_world_writable_place(tmp_path):
    examples = Path(__file__).resolve().parents[3] / "examples"
    for example in examples.glob("*.yaml"):
        text = example.read_text()
        assert "/var/tmp" not in text and "/tmp/" not in text, example
    missing = tmp_path / "c.yaml"
    missing.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB}\n  - {name: nvme, kind: lmdb, capacity: 1GiB}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert ".cache/kvtier/nvme" in str(caught.value)
    assert "add path: such as /var/tmp" not in str(caught.value)


@root_only
@pytest.mark.parametrize("kind", KINDS)
def test_another_user_can_neither_read_replace_nor_plant_in_a_store(kind, shared, attacker, shm):
    """Even in a world-writable (sticky) parent such as /var/tmp, and under umask 000."""
    path = shared / f"kvtier-{kind}"
    old = os.umask(0)
    try:
        make_store(kind, path, shm.rows)
    finally:
        os.umask(old)
    inner = path / ("slab.kvs" if kind == "lmdb" else "blocks/00")
    attempts = {
        "list": f"ls {path}",
        "read": f"cat {path}/kvtier-store.json",
        "read a lock": f"cat {path}/kvtier-store.lock",
        "hold a lock": f"flock -n {path}/kvtier-store.lock true",
        "hold the users lock": f"flock -s -n {path}/kvtier-users.lock true",
        "plant a fifo": f"mkfifo {inner}/planted.kvb",
        "delete": f"rm -rf {path}/*",
    }
    for what, command in attempts.items():
        result = as_user(attacker, command)
        assert result.returncode != 0, f"{what} succeeded: {result.stdout}"
    tier = open_tier(kind, path, shm.rows, 8)
    keys = [key(i) for i in range(4)]
    assert load(tier, shm.rows, keys).ok == keys
    tier.close()


# -- FIFOs and locks ---------------------------------------------------------------------------


def test_a_fifo_under_a_block_name_is_a_failed_read_never_a_hang(tmp_path, shm):
    path = tmp_path / "store"
    make_store("files", path, shm.rows)
    tier = open_tier("files", path, shm.rows, 8)
    block = Path(tier._shown(tier._path_of(key(1), 0)))
    tier.close()
    block.unlink()
    os.mkfifo(block)
    tier = open_tier("files", path, shm.rows, 8)
    result = load(tier, shm.rows, [key(1), key(2)])
    assert result.ok == [key(2)] and holds(shm.rows, 1, key(2))
    tier.close()
    checked = kvtier("check", path, timeout=60)  # a plain open of the FIFO would wait for ever
    assert checked.returncode == 4, checked.stdout + checked.stderr
    assert "not a regular file" in checked.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_a_lock_held_by_another_process_times_out_naming_the_lock(kind, tmp_path, shm):
    path = tmp_path / "store"
    make_store(kind, path, shm.rows)
    lock = path / "kvtier-store.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = config(kind, path, 8, shm.rows.shape[1], lock_timeout_s=0.3)
        with pytest.raises(
            DiskTierError, match=rf"timed out after 0.3 s \(lock_timeout_s\) waiting for the lock {lock}"
        ):
            open_store(cfg, shm.rows, fingerprint(shm.rows.shape[1]), threads=1)
    finally:
        holder.kill()
        holder.wait()
    tier = open_tier(kind, path, shm.rows, 8)  # the lock is free again: opens at once
    assert load(tier, shm.rows, [key(0)]).ok == [key(0)]
    tier.close()


def test_lock_timeout_is_parsed_and_checked(tmp_path):
    base = "tiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB}\n  - {name: nvme, kind: lmdb, capacity: 1GiB, path: /x"
    good = tmp_path / "good.yaml"
    good.write_text(base + ", lock_timeout_s: 5}\n")
    assert load_config(good).tiers[1].lock_timeout_s == 5.0
    bad = tmp_path / "bad.yaml"
    bad.write_text(base + ", lock_timeout_s: 0}\n")
    with pytest.raises(ConfigError, match=r"tiers\[1\].lock_timeout_s"):
        load_config(bad)


# -- the store path itself (issue #32, item 2) ----------------------------------------------------


def system_like_directory(tmp_path) -> Path:
    """A directory of root's (the user running the test) that others may read, holding a
    file: what /etc or /usr/share is."""
    victim = tmp_path / "system"
    victim.mkdir()
    (victim / "config").write_bytes(VICTIM_BYTES)
    victim.chmod(0o755)
    return victim


@root_only
@pytest.mark.parametrize("kind", KINDS)
def test_a_symlink_planted_at_the_store_path_changes_nothing_where_it_points(
    kind, shared, attacker, tmp_path, shm
):
    """The attacker plants the store path, in a sticky world-writable folder, as a symlink
    to a directory of the engine's user: kvtier neither chmods it, nor puts its locks there."""
    victim = system_like_directory(tmp_path)
    link = shared / f"kvtier-{kind}"
    made = as_user(attacker, f"ln -s {victim} {link}")
    assert made.returncode == 0, made.stderr
    with pytest.raises(ConfigError, match="is a symlink"):
        open_tier(kind, link, shm.rows, 8)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755
    assert os.listdir(victim) == ["config"] and (victim / "config").read_bytes() == VICTIM_BYTES
    checked = kvtier("check", link)  # check refuses it too, and --fix changes nothing either
    assert checked.returncode != 0 and "is a symlink" in checked.stderr, checked.stdout + checked.stderr
    kvtier("check", link, "--fix")
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and os.listdir(victim) == ["config"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_symlink_as_the_store_path_is_refused_even_to_an_empty_directory(kind, tmp_path, shm):
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(empty)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*is a symlink.*give the directory's own path"):
        open_tier(kind, tmp_path / "link", shm.rows, 8)
    assert os.listdir(empty) == []
    tier = open_tier(kind, empty, shm.rows, 8)  # its own path is fine
    tier.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_directory_of_other_files_is_refused_before_anything_changes(kind, tmp_path, shm):
    victim = system_like_directory(tmp_path)
    with pytest.raises(ConfigError, match=r"holds other files \(config\)"):
        open_tier(kind, victim, shm.rows, 8)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755  # not made 0700
    assert os.listdir(victim) == ["config"]  # no lock files, no probe left


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_directory_kvtier_did_not_create_keeps_its_mode(kind, tmp_path, shm):
    made = tmp_path / "made-by-hand"
    made.mkdir()
    made.chmod(0o755)
    with pytest.raises(ConfigError, match=r"has mode 755 and holds no kvtier store.*Fix: chmod 700"):
        open_tier(kind, made, shm.rows, 8)
    assert stat.S_IMODE(made.stat().st_mode) == 0o755 and os.listdir(made) == []
    made.chmod(0o700)  # the fix the error names
    make_store(kind, made, shm.rows)
    tier = open_tier(kind, made, shm.rows, 8)
    assert load(tier, shm.rows, [key(1)]).ok == [key(1)]
    tier.close()

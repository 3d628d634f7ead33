"""The CPU region against another local user: private whatever the umask, never attached
through a symlink or when another user owns it, and swept when its creator is dead."""

import os
import secrets
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvtier_testing.users import throwaway_user

from kvtier.errors import KvtierError
from kvtier.tiers.cpu.region import (
    HEADER_BYTES,
    SharedRegion,
    process_start_ticks,
    sweep_stale_regions,
)

SRC = str(Path(__file__).resolve().parents[3] / "src")
# where the creator's start time and pid namespace sit in the header (after the 48 bytes of
# magic, version, geometry and pid, then the start time, the uid, the namespace)
START_OFFSET, NAMESPACE_OFFSET = 48, 64


@pytest.fixture
def attacker():
    """A throwaway unprivileged user (uid, gid), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a throwaway user")
    with throwaway_user("kvatk", "-r") as entry:
        yield entry.pw_uid, entry.pw_gid


def as_user(user, *argv):
    uid, gid = user
    return subprocess.run(list(argv), user=uid, group=gid, extra_groups=[], check=True, capture_output=True)


@pytest.fixture
def shared_dir():
    """A world-writable sticky folder in shared memory, like /dev/shm itself."""
    path = Path("/dev/shm") / f"kvtier-test-dir-{secrets.token_hex(4)}"
    path.mkdir()
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_the_region_is_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        region = SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-r"))
    finally:
        os.umask(old)
    with region:
        assert stat.S_IMODE(os.stat(region.path).st_mode) == 0o600
        with SharedRegion.attach(region.path) as other:  # the user's own workers can attach
            other.row(0)[:] = 7
        assert int(region.row(0)[0]) == 7


def test_attach_refuses_a_symlink_to_a_real_region(tmp_path):
    with SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-real")) as region:
        link = tmp_path / "kvtier-link"
        link.symlink_to(region.path)
        with pytest.raises(KvtierError, match="symlink"):
            SharedRegion.attach(str(link))


def test_attach_refuses_a_region_writable_by_others(tmp_path):
    with SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-r")) as region:
        os.chmod(region.path, 0o666)
        with pytest.raises(KvtierError, match="writable by other users"):
            SharedRegion.attach(region.path)


def test_attach_refuses_a_region_another_user_planted(attacker, shared_dir, tmp_path):
    # a complete, valid region file, as the attacker would make one
    with SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-template")) as template:
        copy = shared_dir / "template-copy"
        shutil.copyfile(template.path, copy)
    copy.chmod(0o644)
    planted = shared_dir / "kvtier-engine0"  # a name guessable under vLLM
    as_user(attacker, "cp", str(copy), str(planted))
    as_user(attacker, "chmod", "600", str(planted))
    with pytest.raises(KvtierError, match=f"owned by uid {attacker[0]}"):
        SharedRegion.attach(str(planted))
    # naming that user as the creator is the explicit way to accept it
    SharedRegion.attach(str(planted), owner_uid=attacker[0]).close()
    # and a symlink the attacker plants at the name, to a file of the victim's, is refused
    victim = tmp_path / "victim-file"
    victim.write_bytes(b"secret")
    link = shared_dir / "kvtier-engine1"
    as_user(attacker, "ln", "-s", str(victim), str(link))
    with pytest.raises(KvtierError, match="symlink"):
        SharedRegion.attach(str(link))
    assert victim.read_bytes() == b"secret"


def _create_and_die(path):
    """A region whose creator exits without removing it (as SIGKILL or a crash leaves it)."""
    code = textwrap.dedent(f"""
        import os
        from kvtier.tiers.cpu.region import SharedRegion
        region = SharedRegion.create(2, 64, path={str(path)!r}, sweep=False)
        os._exit(0)  # no clean-up, as after SIGKILL
    """)
    env = {**os.environ, "PYTHONPATH": SRC}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert path.exists()


def _patch(path, offset, value):
    with open(path, "r+b") as region:
        region.seek(offset)
        region.write(value.to_bytes(8, "little"))


def test_a_start_sweeps_regions_whose_creator_died(tmp_path):
    dead = tmp_path / "kvtier-dead"
    _create_and_die(dead)
    (tmp_path / "kvtier-not-a-region").write_bytes(b"\0" * HEADER_BYTES)  # no header: kept
    (tmp_path / "other-name").write_bytes(b"x")
    with SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-live")) as live:
        assert not dead.exists()  # the create swept it
        assert sweep_stale_regions(str(tmp_path)) == []  # a live creator's region stays
        assert os.path.exists(live.path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtier-not-a-region", "other-name"]


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path):
    assert process_start_ticks(os.getpid()) > 0
    with SharedRegion.create(2, 64, path=str(tmp_path / "kvtier-mine")) as region:
        # the header says: created by this pid, but by a process that started at another time
        _patch(region.path, START_OFFSET, process_start_ticks(os.getpid()) + 1)
        assert sweep_stale_regions(str(tmp_path)) == [region.path]
        assert not os.path.exists(region.path)


def test_a_region_from_another_pid_namespace_is_never_swept(tmp_path):
    dead = tmp_path / "kvtier-elsewhere"
    _create_and_die(dead)
    _patch(dead, NAMESPACE_OFFSET, 12345)  # made in another container sharing the folder
    assert sweep_stale_regions(str(tmp_path)) == []
    assert dead.exists()


def test_the_sweep_never_touches_another_users_region_or_follows_a_symlink(attacker, shared_dir, tmp_path):
    dead = tmp_path / "kvtier-dead"
    _create_and_die(dead)
    copy = shared_dir / "copy"
    shutil.copyfile(dead, copy)
    copy.chmod(0o644)
    theirs = shared_dir / "kvtier-theirs"
    as_user(attacker, "cp", str(copy), str(theirs))  # a dead creator's region, their file
    copy.unlink()
    link = shared_dir / "kvtier-link"
    os.symlink(dead, link)  # ours, dead, but reached through a symlink
    assert sweep_stale_regions(str(shared_dir)) == []
    assert theirs.exists() and link.is_symlink() and dead.exists()
    assert sweep_stale_regions(str(tmp_path)) == [str(dead)]


def test_a_restart_at_the_same_path_takes_the_place_of_a_killed_run(tmp_path):
    from kvtier.tiers.cpu.backend import CPUBackend
    from kvtier.tiers.cpu.config import CPUTierConfig

    path = tmp_path / "kvtier-engine0"  # a fixed name, as under vLLM
    _create_and_die(path)
    config = CPUTierConfig(name="cpu", kind="cpu", capacity_bytes=5 * 4096, path=str(path), pin_memory="off")
    backend = CPUBackend.from_config(config, 4096)
    try:
        assert backend.region.path == str(path) and backend.region.is_creator
    finally:
        backend.shutdown()
    assert not path.exists()


def test_a_region_named_after_a_stem_cannot_be_taken_first(attacker, shared_dir, tmp_path):
    """Issue #32, item 6: an engine's region name is derived from its engine id, which another
    user may know; the creator adds a random suffix, the attaching side finds it, and what
    the other user put at the name (or at a guessed suffix, or a link to ours) is passed over."""
    from kvtier.tiers.cpu.region import find_region, unique_region_path

    stem = str(shared_dir / "kvtier-engine-7")
    as_user(attacker, "touch", stem)  # what stopped the engine: the derived name, taken first
    as_user(attacker, "sh", "-c", f"head -c 8192 /dev/zero > {stem}-{'0' * 16}")
    assert find_region(stem) is None
    dead = Path(f"{stem}-{'1' * 16}")
    _create_and_die(dead)  # ours, but its creator is gone: not the engine's region
    path = unique_region_path(stem)
    with SharedRegion.create(2, 64, path=path, sweep=False) as region:
        os.symlink(path, f"{stem}-{'f' * 16}")  # a link to ours is never followed either
        assert find_region(stem) == path != stem
        attached = SharedRegion.attach(find_region(stem))
        region.rows[1, :5] = list(b"hello")
        assert bytes(attached.rows[1, :5]) == b"hello"  # the same memory
        attached.close()
    assert find_region(stem) is None  # gone with its creator

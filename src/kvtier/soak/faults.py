"""The faults the soak injects, one function each, every one real (no patched functions).

* :func:`kill_writer` — a writer process on a store of its own, SIGKILLed at a random point;
  then the store is checked (and fixed if need be) and every block it reported stored is
  read back and compared.
* :class:`SmallFilesystem` — the main disk tier's directory is a tmpfs of its own (root only),
  which :meth:`SmallFilesystem.fill` fills with another file and :meth:`SmallFilesystem.free`
  empties again.
* :func:`corrupt_blocks` — bytes of committed blocks flipped on disk, under the running tier.
* :func:`start_sharer` — a second process storing, loading and evicting on the main store
  while the soak's stack uses it.

Each returns what it saw (blocks checked, wrong bytes served, committed blocks lost, fixes),
for the soak to add up.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kvtier.base import OffloadKey
from kvtier.soak.blocks import is_exact
from kvtier.soak.store_process import open_tier
from kvtier.tiers.base import TierJob
from kvtier.tiers.cpu.region import SharedRegion
from kvtier.tiers.disk import check_store
from kvtier.tiers.disk.format import HEADER_BYTES
from kvtier.tiers.disk.scan import find_blocks

__all__ = [
    "KillOutcome",
    "SmallFilesystem",
    "corrupt_blocks",
    "kill_writer",
    "start_sharer",
    "sharer_outcome",
]

_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(args: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.soak.store_process", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,
    )


@dataclass
class KillOutcome:
    """What one kill of a writer left behind."""

    committed: int = 0  # blocks the writer reported stored before it died
    verified: int = 0  # of those, read back byte for byte after the kill
    wrong: int = 0  # served with bytes that are not the key's
    lost: int = 0  # reported stored, not served after the kill
    fixed: list[str] = field(default_factory=list)  # what `check --fix` had to repair


def kill_writer(
    kind: str,
    path: str,
    capacity_blocks: int,
    block_bytes: int,
    first_key: int,
    shm_dir: str,
    rng: random.Random,
) -> tuple[KillOutcome, list[OffloadKey]]:
    """Run a writer on ``path``, SIGKILL it after a random 1-10 jobs and 0-20 ms, then check
    the store and read back every block it reported; ``(outcome, keys committed)``.

    The store must be large enough that the writer never evicts (the soak starts a new one
    before it could), so every reported block must still be there.
    """
    writer = _child(
        [
            "writer",
            kind,
            path,
            str(capacity_blocks),
            str(block_bytes),
            str(first_key),
            "soak-writer",
            "--shm-dir",
            shm_dir,
        ]
    )
    assert writer.stdout is not None and writer.stderr is not None  # pipes (_child)
    committed: list[OffloadKey] = []
    try:
        if writer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the soak's writer did not start: {writer.stderr.read()}")
        for _ in range(rng.randint(1, 10)):
            line = writer.stdout.readline()
            if not line:
                break
            committed.extend(OffloadKey(bytes.fromhex(h)) for h in line.split())
        time.sleep(rng.uniform(0, 0.02))
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    committed.extend(
        OffloadKey(bytes.fromhex(h)) for line in writer.stdout.read().splitlines() for h in line.split()
    )
    outcome = KillOutcome(committed=len(committed))
    report = check_store(path)
    if not report.healthy:
        outcome.fixed = check_store(path, fix=True).fixed
    region = SharedRegion.create(
        8, block_bytes, path=os.path.join(shm_dir, f"kvtier-soak-check-{os.getpid()}")
    )
    try:
        tier = open_tier(kind, path, capacity_blocks, block_bytes, region.rows)
        try:
            served, wrong = read_back(tier, region.rows, committed)
        finally:
            tier.close()
    finally:
        region.close()
    outcome.verified = len(served)
    outcome.wrong = wrong
    outcome.lost = len(committed) - len(served)
    return outcome, committed


def read_back(tier, rows, keys: list[OffloadKey]) -> tuple[list[OffloadKey], int]:
    """Load ``keys`` from ``tier`` in jobs of ``len(rows)``; ``(keys served, wrong among them)``."""
    served: list[OffloadKey] = []
    wrong = 0
    width = rows.shape[0]
    for first in range(0, len(keys), width):
        batch = tuple(keys[first : first + width])
        job = TierJob(first + 1, batch, tuple(range(len(batch))))
        tier.submit_load(job)
        tier.drain_jobs()
        (result,) = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
        for row, key in enumerate(batch):
            if key in result.ok:
                served.append(key)
                wrong += not is_exact(rows[row], key)
    return served, wrong


class SmallFilesystem:
    """A tmpfs of ``size_bytes`` mounted at ``path`` (root only), that can be filled and freed.

    :meth:`mount` returns ``None`` on success, else why it cannot (not root, mount refused),
    and the soak then leaves this fault out and says so.
    """

    def __init__(self, path: str, size_bytes: int):
        self.path = path
        self.size_bytes = size_bytes
        self.mounted = False
        self._filler = os.path.join(path, "soak-filler")

    def mount(self) -> str | None:
        if os.geteuid() != 0:
            return "filling a filesystem needs a small tmpfs of its own, and mounting one needs root"
        if shutil.which("mount") is None:
            return "no mount(8) here"
        os.makedirs(self.path, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", self.path],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            return f"cannot mount a tmpfs: {done.stderr.strip()}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Another file takes every free byte; returns its size."""
        chunk = b"\x5a" * (1 << 16)
        written = 0
        with open(self._filler, "ab", buffering=0) as stream:
            size = len(chunk)
            while size:
                try:
                    written += stream.write(chunk[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    size //= 2
        return written

    def free(self) -> None:
        try:
            os.unlink(self._filler)
        except FileNotFoundError:
            pass

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], capture_output=True, check=False)
            self.mounted = False


def corrupt_blocks(tier, keys: list[OffloadKey], rng: random.Random) -> list[OffloadKey]:
    """Flip one payload byte of each of ``keys`` on disk, under the running ``tier``; the keys
    damaged. Blocks are found from outside the tier, by their headers
    (:func:`~kvtier.tiers.disk.scan.find_blocks`); every copy of a key is damaged, so the live
    one is whatever stale slots hold."""
    wanted = set(keys)
    damaged: dict[OffloadKey, None] = {}
    for path, offset, key in find_blocks(tier.path, tier.block_bytes):
        if key not in wanted:
            continue
        at = offset + HEADER_BYTES + rng.randrange(tier.block_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # evicted since the scan
        try:
            byte = os.pread(fd, 1, at)
            if len(byte) != 1:
                continue
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
        finally:
            os.close(fd)
        damaged[OffloadKey(key)] = None
    return list(damaged)


def start_sharer(
    kind: str,
    path: str,
    capacity_blocks: int,
    block_bytes: int,
    seed: int,
    seconds: float,
    universe: int,
    shm_dir: str,
) -> subprocess.Popen:
    """A second process storing, loading and evicting on ``path`` for ``seconds`` (its own keys)."""
    return _child(
        [
            "sharer",
            kind,
            path,
            str(capacity_blocks),
            str(block_bytes),
            str(seed),
            str(seconds),
            str(universe),
            "soak-sharer",
            "--shm-dir",
            shm_dir,
        ]
    )


def sharer_outcome(process: subprocess.Popen) -> dict:
    """The finished sharer's tally (its last JSON line); raises if it failed."""
    out, err = process.communicate(timeout=300)
    if process.returncode != 0:
        raise RuntimeError(f"the soak's sharer failed ({process.returncode}): {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])

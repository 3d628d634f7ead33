"""``kvtier soak``: mixed load over a real CPU + disk stack, with faults on a schedule.

The load is an engine's: requests over shared prefixes (64 prefix families of 16 blocks,
the popular ones much more often), each looked up block by block (stepping while an answer
is ``None``, as a read comes up from disk), its cached prefix loaded and compared byte for
byte with what its key must hold, the rest "computed" and stored. The CPU tier holds 128
blocks, far fewer than the 1,024 the requests touch, so blocks keep moving down to the disk
tier (``write_back``) and back up.

With ``--faults``, one fault every ``duration / 6`` (at least one of each kind in any run),
in turn:

1. **writer killed** — a writer process on a store of its own, SIGKILLed at a random point;
   the store is checked (``--fix`` if need be) and every block it reported stored is read back;
2. **filesystem filled** — the main disk tier lives on a tmpfs of its own (root only; left out,
   and said so, otherwise), which another file fills for a while (at least 40 requests, over
   prefixes of their own, so there are new blocks to save): demotions fail, the load goes
   on, then the file goes and stores succeed again;
3. **blocks corrupted** — a byte flipped in up to 8 committed blocks on disk, under the tier;
4. **store shared** — a second process stores, loads and evicts on the main store for a while.

After each fault, and at the end, a **checkpoint** restarts the stack on the same store and
reads back every block the disk tier ever reported stored (from its events), except the ones
the soak damaged on purpose. The main store is large enough that nothing is evicted from it,
so each of those blocks must be served, exact: ``committed_blocks_lost`` counts those that are
not, ``wrong_blocks_served`` every block anywhere served with bytes not its own (the damaged
ones included). Both must be 0 (the exit code is 1 otherwise).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Any, TextIO

import kvtier
from kvtier.base import OffloadKey
from kvtier.bench.report import print_counts
from kvtier.soak.blocks import block_key
from kvtier.soak.engine import BLOCK_BYTES, FAMILIES, FAMILY_BLOCKS, SoakEngine, soak_stack
from kvtier.soak.faults import SmallFilesystem, corrupt_blocks, kill_writer, sharer_outcome, start_sharer
from kvtier.tiers.disk.format import on_disk_block_bytes

__all__ = ["FAULTS", "run"]

#: the faults, in the order the schedule injects them
FAULTS = ("writer_killed", "filesystem_filled", "blocks_corrupted", "store_shared")

SHARER_UNIVERSE = 256
#: prefix families requested while the filesystem is full: new blocks, so demotions meet it
FILL_FAMILIES = 8
#: room for every key the engine and the sharer use: the main store never evicts
DISK_BLOCKS = (FAMILIES + FILL_FAMILIES) * FAMILY_BLOCKS + SHARER_UNIVERSE + 256
KILLED_STORE_BLOCKS = 2048


def _disk_config(kind: str, path: str) -> dict:
    """The soak's stack: the CPU tier over one disk tier at ``path``, ``write_back``."""
    disk = {
        "name": "disk",
        "kind": kind,
        "path": path,
        "eviction": "lru",
        "fsync": "batch",
        "capacity": DISK_BLOCKS * on_disk_block_bytes(BLOCK_BYTES),
    }
    return soak_stack(disk, "write_back")


def _checkpoint(
    engine: SoakEngine, kind: str, path: str, counts: Counter, damaged: set[OffloadKey]
) -> SoakEngine:
    """Restart the stack on the store and read back every committed block; the new engine."""
    _fold_disk_stats(engine, counts)
    engine.shutdown()
    fresh = SoakEngine(_disk_config(kind, path), counts, engine.committed)
    expected = [key for key in fresh.committed if key not in damaged]
    for first in range(0, len(expected), 32):
        batch = expected[first : first + 32]
        answers = fresh.resolve(batch)
        found = [key for key, ok in zip(batch, answers) if ok]
        if found:
            fresh.serve(found)
        counts["committed_blocks_lost"] += len(batch) - len(found)
        counts["committed_verified"] += len(found)
        fresh.manager.reset_cache()  # make room: the next batch comes from disk again
    # blocks damaged on purpose: a miss each, or their true bytes (a copy from before the damage)
    hurt = [key for key in damaged if fresh.tier.lookup(key)]
    if hurt:
        answers = fresh.resolve(hurt)
        found = [key for key, ok in zip(hurt, answers) if ok]
        if found:
            fresh.serve(found)
    counts["checkpoints"] += 1
    return fresh


def _fold_disk_stats(engine: SoakEngine, counts: Counter) -> None:
    """Add the disk tier's failure and corruption counters to the soak's (each engine once)."""
    for name, value in engine.tier.stats().items():
        if name.startswith("failed_") or name in ("corrupt", "adopted"):
            counts[f"disk.{name}"] += value


def run(
    minutes: float = 1.0,
    faults: bool = False,
    kind: str = "lmdb",
    directory: str | None = None,
    seed: int = 0,
    out: TextIO = sys.stdout,
) -> dict[str, Any]:
    """Run the soak for ``minutes``; print a table; the JSON record."""
    if kind not in ("lmdb", "files"):
        raise kvtier.ConfigError("--kind", kind, "lmdb or files")
    if not minutes > 0:
        raise kvtier.ConfigError(
            "--minutes", minutes, "a positive number of minutes", "e.g. --minutes 1 (0.1 for six seconds)"
        )
    if directory is not None and not os.path.isdir(directory):
        raise kvtier.ConfigError(
            "--dir",
            directory,
            "an existing directory (the soak makes its stores in a new folder inside it)",
            f"create it first (mkdir -p {directory}) or leave --dir out for the system's temporary folder",
        )
    rng = random.Random(seed)
    try:
        work = tempfile.mkdtemp(prefix="kvtier-soak-", dir=directory)
    except OSError as exc:
        raise kvtier.ConfigError(
            "--dir",
            directory,
            "a directory this user can create folders in",
            f"it refused a new folder ({exc.strerror}): pick another --dir",
        ) from None
    counts: Counter = Counter()
    injected: Counter = Counter()
    left_out: dict[str, str] = {}
    damaged: set[OffloadKey] = set()
    committed: dict[OffloadKey, None] = {}
    small_fs = SmallFilesystem(
        os.path.join(work, "disk"), DISK_BLOCKS * on_disk_block_bytes(BLOCK_BYTES) + (24 << 20)
    )
    if faults:
        reason = small_fs.mount()
        if reason:
            left_out["filesystem_filled"] = reason
    store = os.path.join(small_fs.path, "store")
    os.makedirs(small_fs.path, exist_ok=True)
    killed_store = os.path.join(work, "killed-store")
    weights = [1.0 / (f + 1) for f in range(FAMILIES)]  # popular prefixes come back often
    duration = minutes * 60.0
    period = duration / 6
    schedule = [name for name in FAULTS if name not in left_out] if faults else []
    engine = SoakEngine(_disk_config(kind, store), counts, committed)
    started = time.monotonic()
    next_fault, turn, writer_key = started + period, 0, 0
    sharer = None
    fill_until, fill_requests = 0.0, 0
    try:
        while True:
            now = time.monotonic()
            done_faults = not schedule or turn >= len(schedule)
            if (
                now - started >= duration
                and done_faults
                and sharer is None
                and not fill_until
                and counts["requests"]
            ):
                break
            if fill_until:  # prefixes of their own: blocks the CPU tier must try to save
                family, length, salt = rng.randrange(FILL_FAMILIES), FAMILY_BLOCKS, "soak-fill"
            else:
                family, length, salt = (
                    rng.choices(range(FAMILIES), weights)[0],
                    rng.randint(2, FAMILY_BLOCKS),
                    "soak",
                )
            engine.request([block_key(family * FAMILY_BLOCKS + i, salt) for i in range(length)])
            if fill_until and now >= fill_until and counts["requests"] >= fill_requests:
                small_fs.free()  # room again: stores succeed again from here
                fill_until = 0.0
                engine = _checkpoint(engine, kind, store, counts, damaged)
            if sharer is not None and sharer.poll() is not None:
                tally = sharer_outcome(sharer)
                sharer = None
                counts["wrong_blocks_served"] += tally["wrong"]
                counts["sharer_blocks"] += tally["store_ok"] + tally["load_ok"]
                engine = _checkpoint(engine, kind, store, counts, damaged)
            if not schedule or now < next_fault or sharer is not None or fill_until:
                continue
            fault = schedule[turn % len(schedule)]
            turn += 1
            next_fault = now + period
            injected[fault] += 1
            if fault == "writer_killed":
                if writer_key > KILLED_STORE_BLOCKS // 2:  # a fresh store before the writer could evict
                    shutil.rmtree(killed_store, ignore_errors=True)
                    writer_key = 0
                outcome, written = kill_writer(
                    kind, killed_store, KILLED_STORE_BLOCKS, BLOCK_BYTES, writer_key, work, rng
                )
                writer_key += 1000
                counts["writer_committed"] += outcome.committed
                counts["committed_verified"] += outcome.verified
                counts["committed_blocks_lost"] += outcome.lost
                counts["wrong_blocks_served"] += outcome.wrong
                counts["writer_stores_fixed"] += bool(outcome.fixed)
                engine = _checkpoint(engine, kind, store, counts, damaged)
            elif fault == "filesystem_filled":
                counts["filler_bytes"] += small_fs.fill()
                # for a while, and for enough requests that demotions meet the full disk
                fill_until = now + min(period / 2, 5.0)
                fill_requests = counts["requests"] + 40
            elif fault == "blocks_corrupted":
                on_disk = [key for key in committed if key not in damaged]
                chosen = rng.sample(on_disk, min(8, len(on_disk)))
                damaged.update(corrupt_blocks(engine.tier, chosen, rng))
                engine = _checkpoint(engine, kind, store, counts, damaged)
            else:
                sharer = start_sharer(
                    kind,
                    store,
                    DISK_BLOCKS,
                    BLOCK_BYTES,
                    rng.randrange(1 << 30),
                    min(period / 2, 5.0),
                    SHARER_UNIVERSE,
                    work,
                )
        engine = _checkpoint(engine, kind, store, counts, damaged)
        _fold_disk_stats(engine, counts)
        engine.manager.shutdown()
    finally:
        if sharer is not None and sharer.poll() is None:
            sharer.kill()
            sharer.wait()
        small_fs.free()
        small_fs.unmount()
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    operations = (
        counts["lookups"]
        + counts["blocks_loaded"]
        + counts["blocks_stored"]
        + counts["sharer_blocks"]
        + counts["writer_committed"]
    )
    failures = {
        name[len("disk.failed_") :]: value
        for name, value in counts.items()
        if name.startswith("disk.failed_") and name != "disk.failed_keys" and value
    }
    record = {
        "soak": kind,
        "seconds": round(elapsed, 1),
        "operations": operations,
        "requests": counts["requests"],
        "blocks_loaded": counts["blocks_loaded"],
        "blocks_stored": counts["blocks_stored"],
        "faults_injected": sum(injected.values()),
        "faults": dict(injected),
        "faults_left_out": left_out,
        "checkpoints": counts["checkpoints"],
        "committed_verified": counts["committed_verified"],
        "committed_blocks_lost": counts["committed_blocks_lost"],
        "wrong_blocks_served": counts["wrong_blocks_served"],
        "blocks_damaged": len(damaged),
        "corrupt_detected": counts["disk.corrupt"],
        "failed_keys_by_reason": failures,  # the disk tier's failed_<reason> counters, all engines
        "killed_stores_fixed": counts["writer_stores_fixed"],
        "adopted_blocks": counts["disk.adopted"],
    }
    print_counts(
        record,
        (
            "operations",
            "requests",
            "blocks_loaded",
            "blocks_stored",
            "faults_injected",
            "checkpoints",
            "committed_verified",
            "blocks_damaged",
            "corrupt_detected",
            "committed_blocks_lost",
            "wrong_blocks_served",
        ),
        out,
    )
    for name, reason in left_out.items():
        print(f"fault left out: {name}: {reason}", file=out)
    return record

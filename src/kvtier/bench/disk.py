"""``kvtier bench disk``: a disk tier's write and cold-read rates against the raw device, one run.

Protocol (each round; ``--rounds`` rounds, the median of each figure is reported, and each
ratio is the median of the rounds' own kvtier/baseline ratios):

1. CPU rows: a real CPU-tier region (:class:`~kvtier.tiers.cpu.region.SharedRegion`, in /dev/shm)
   of ``--gib`` GiB as 2 MiB rows, each row distinct bytes; their xxh3-64 are kept.
2. kvtier write: a fresh store of the backend (capacity = exactly those blocks, ``fsync:
   batch`` unless ``--fsync`` says, ``o_direct: auto``) in a fresh directory under ``--dir``; every
   block submitted as store jobs of 16 blocks, all at once; timed from the first submission
   until every job finished (index committed, data flushed). Every key must be stored.
   ``--fsync end`` (the bench's own, not a tier policy): the tier under ``fsync: none``, and
   one ``syncfs`` of its filesystem inside the timed write, after the last job: durable at
   the end, as the baseline is.
3. kvtier read: the rows zeroed; the page cache emptied of the store where the reads are not
   O_DIRECT anyway (``cold_read_method``); every block loaded back into its row as load jobs
   of 16; timed the same way. Every key must load, verified by the tier.
4. kvtier write into a full store (``full_write_gbps``): the same rows stored again under new
   keys, each block evicting one, timed as step 2 (a full store is where a serving engine's
   tier spends its life); then loaded back, untimed. Every row must now match its checksum
   from step 1: the bytes went through both writes and both reads.
5. baseline: the same bytes from the same rows, by the same number of threads, written with
   O_DIRECT as 2 MiB chunks into one preallocated (fallocate) file in the same directory, one
   fdatasync at the end; then read back with O_DIRECT. No format, no index, no checksum: the
   device's limit through the same Python I/O calls.

The order of kvtier and baseline alternates between rounds, so neither always meets the disk
in the state the other left. ``write_ratio`` / ``read_ratio`` / ``full_write_ratio`` are kvtier
over baseline (the full store's write against the baseline's write): the
median of the rounds' own ratios, with their lowest and highest (``write_ratio_range`` ...).
The machine's 1-minute load average is noted before the first round (``load_before``) and as
each round starts (``load``; ``load_range`` over the run, which counts the bench's own I/O
threads too while they wait for the disk). The tier spends several times the baseline's CPU
per GB (``write_cpu_s_per_gb`` against ``baseline_write_cpu_s_per_gb``: the file system's
work for a file per block, the checksum, the threads), so where other jobs keep the cores
busy its ratios fall while the baseline's rate holds (docs/design/disk.md#the-files-tiers-write-gap-on-a-busy-machine).

Durability: the baseline makes its bytes durable once, at the end; the tier under ``fsync:
batch`` makes each job's blocks durable before reporting it (one ``syncfs``, shared by the
jobs finishing together), a stronger promise that costs flushes during the run.

When vLLM imports (the CPU-only environment of docs/bench.md), each round also runs vLLM 0.33's
fs tier I/O path on the same bytes (``vllm_fs_write_gbps``/``vllm_fs_read_gbps``; see
``_vllm_fs_round``): its 16+16 threads, O_DIRECT, and no fsync at all.

``open_s``: a second store of 100,000 blocks (4 KiB each, so that it builds in seconds) is
written through the same backend and mover (``fsync: none``: durability is not what is
measured), closed, and reopened; ``open_s`` is the wall time of the whole ``open`` call
(directory checks, locks, manifest, O_DIRECT probe, index scan). ``open_cold_s`` repeats it
after dropping the page cache, when this process may (root).

With ``--secrets`` each round also runs the kvtier write and read with a ``secret_file``
(``keyed``: every block tagged with GMAC and verified on read) and with ``encrypt: aes-gcm``
(``encrypted``), the three in an order that rotates between rounds;
``keyed_write_cost`` etc. are 1 - (that variant's rate / the plain tier's rate in the same
round), the median over rounds: what the secret costs in throughput.

Without vLLM, ``VLLM_FS_REFERENCE`` stands in for its fs tier's figures.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from statistics import median
from typing import Any, TextIO

import numpy as np
import xxhash

from kvtier.base import OffloadKey
from kvtier.bench.report import print_table
from kvtier.errors import ConfigError
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk import open_store
from kvtier.tiers.base import TierJob
from kvtier.tiers.disk.format import LayoutFingerprint, on_disk_block_bytes
from kvtier.tiers.disk.blockio import O_DIRECT, probe_o_direct
from kvtier.tiers.disk.mover import DEFAULT_THREADS
from kvtier.tiers.disk.syscalls import syncfs
from kvtier.tiers.cpu.region import SharedRegion

__all__ = ["FSYNC_AT_END", "VLLM_FS_REFERENCE", "default_directory", "run"]

BLOCK_BYTES = 2 << 20
JOB_BLOCKS = 16
#: ``--fsync end``: the tier unflushed, then one flush of its filesystem, as the baseline
FSYNC_AT_END = "end"
OPEN_BLOCKS = 100_000
OPEN_BLOCK_BYTES = 4096
#: vLLM 0.33's fs tier on this machine kind (GB/s; 16+16 threads, 1 GiB of 2 MiB chunks)
VLLM_FS_REFERENCE = {"store_gbps": (2.6, 3.3), "load_gbps": (0.5, 1.7)}


def default_directory() -> str:
    """A disk-backed place for the benchmark's stores: ``/var/tmp`` (on disk on every common
    Linux layout, where ``/tmp`` is a tmpfs on some), else the system temp directory."""
    return "/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()


def _filesystem(directory: str) -> str:
    """The filesystem type holding ``directory`` (from /proc/mounts), or ``unknown``."""
    best, kind = "", "unknown"
    real = os.path.realpath(directory)
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) < 3 or len(parts[1]) <= len(best):
                continue
            if real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"):
                best, kind = parts[1], parts[2]
    return kind


def _drop_page_cache(paths: list[str], system_wide: bool = True) -> str:
    """Empty the page cache of ``paths`` as far as this process may; the method that worked.

    ``system_wide``: also write /proc/sys/vm/drop_caches (needs root; empties every cache on
    the machine, which is what makes a cold read honest, and what tests must not do).
    """
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if not system_wide:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def _store_files(directory: str) -> list[str]:
    found: list[str] = []
    for root, _, names in os.walk(directory):
        found.extend(os.path.join(root, name) for name in names)
    return found


def make_bench_secret() -> tuple[str, str]:
    """A throwaway secret file (0600, in a private 0700 directory): ``(directory, file)``.
    The caller removes the directory."""
    directory = tempfile.mkdtemp(prefix="kvtier-bench-secret-")
    path = os.path.join(directory, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)
    return directory, path


def secret_variants(secret_file: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The tier settings a bench measures beside the plain tier: none without a secret file,
    else ``keyed`` (a MAC per block) and ``encrypted`` (AES-GCM)."""
    if secret_file is None:
        return []
    return [
        ("keyed", {"secret_file": secret_file}),
        ("encrypted", {"secret_file": secret_file, "encrypt": "aes-gcm"}),
    ]


def _keys(count: int, salt: bytes) -> list[OffloadKey]:
    return [
        OffloadKey(xxhash.xxh3_128_digest(salt + i.to_bytes(8, "little")) + b"\0\0\0\0") for i in range(count)
    ]


def _run_jobs(tier, keys: list[OffloadKey], rows: list[int], load: bool, job_base: int) -> float:
    """Submit every block as jobs of JOB_BLOCKS, wait for all; seconds. Raises if any key failed."""
    start = time.perf_counter()
    for job_index, first in enumerate(range(0, len(keys), JOB_BLOCKS)):
        job = TierJob(
            job_base + job_index,
            tuple(keys[first : first + JOB_BLOCKS]),
            tuple(rows[first : first + JOB_BLOCKS]),
        )
        (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    seconds = time.perf_counter() - start
    failed = {}
    for result in tier.get_finished_jobs():
        failed.update(result.failed)
    if failed:
        reasons = sorted(set(failed.values()))
        raise RuntimeError(f"{len(failed)} blocks failed to {'load' if load else 'store'}: {reasons}")
    return seconds


def _kvtier_round(
    kind: str,
    region: SharedRegion,
    directory: str,
    threads: int,
    sums: list[int],
    drop_caches: bool,
    fsync: str,
    **secret_options: Any,
) -> dict[str, Any]:
    rows = region.rows
    count = region.num_rows
    os.sync()  # the previous run's writes and deletions land before this run's clock starts
    path = tempfile.mkdtemp(prefix=f"kvtier-bench-{kind}-", dir=directory)
    config = DiskTierConfig(
        name="bench",
        kind=kind,
        capacity_bytes=count * on_disk_block_bytes(BLOCK_BYTES),
        path=path,
        fsync="none" if fsync == FSYNC_AT_END else fsync,
        **secret_options,
    )
    keys = _keys(count, kind.encode())
    try:
        tier = open_store(
            config, rows, LayoutFingerprint.standalone(BLOCK_BYTES), field="bench", threads=threads
        )

        def write(keys: list[OffloadKey], job_base: int) -> tuple[float, float]:
            """Store every row under ``keys``, durable as ``fsync`` says; wall and CPU seconds."""
            cpu = time.process_time()
            start = time.perf_counter()
            _run_jobs(tier, keys, list(range(count)), load=False, job_base=job_base)
            if fsync == FSYNC_AT_END:
                _sync_filesystem(path)
            return time.perf_counter() - start, time.process_time() - cpu

        try:
            write_s, write_cpu = write(keys, 0)
            rows[:] = 0
            method = "o_direct" if tier.o_direct else _drop_page_cache(_store_files(path), drop_caches)
            cpu = time.process_time()
            read_s = _run_jobs(tier, keys, list(range(count)), load=True, job_base=1 << 20)
            read_cpu = time.process_time() - cpu
            # the store is full: as many blocks again under new keys, each evicting one
            full_keys = _keys(count, kind.encode() + b"-full")
            full_write_s, _ = write(full_keys, 2 << 20)
            rows[:] = 0  # what the full store holds now comes back, compared below
            _run_jobs(tier, full_keys, list(range(count)), load=True, job_base=3 << 20)
            o_direct = tier.o_direct
        finally:
            tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    wrong = sum(1 for i in range(count) if xxhash.xxh3_64_intdigest(rows[i]) != sums[i])
    if wrong:
        raise RuntimeError(f"{wrong} rows differ from what was stored")
    nbytes = count * BLOCK_BYTES
    return {
        "write_gbps": nbytes / write_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
        "full_write_gbps": nbytes / full_write_s / 1e9,
        # CPU seconds of this process (every thread) per GB moved: what a secret adds, free
        # of the disk's drift (the rates swing +-25% here from round to round)
        "write_cpu_s_per_gb": write_cpu / (nbytes / 1e9),
        "read_cpu_s_per_gb": read_cpu / (nbytes / 1e9),
        "cold_read_method": method,
        "o_direct": o_direct,
    }


def _sync_filesystem(path: str) -> None:
    """Make everything written on ``path``'s filesystem durable: syncfs, else sync."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _baseline_round(
    region: SharedRegion, directory: str, threads: int, drop_caches: bool
) -> dict[str, float]:
    rows = region.rows
    count = region.num_rows
    nbytes = count * BLOCK_BYTES
    path = os.path.join(directory, f".kvtier-bench-baseline-{os.getpid()}")
    direct = O_DIRECT if probe_o_direct(directory).supported else 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)

        def write(i: int) -> None:
            if os.pwrite(fd, rows[i], i * BLOCK_BYTES) != BLOCK_BYTES:
                raise OSError("short write")

        def read(i: int) -> None:
            if os.preadv(fd, [rows[i]], i * BLOCK_BYTES) != BLOCK_BYTES:
                raise OSError("short read")

        with ThreadPoolExecutor(threads) as pool:
            cpu = time.process_time()
            start = time.perf_counter()
            list(pool.map(write, range(count)))
            os.fdatasync(fd)
            write_s = time.perf_counter() - start
            write_cpu = time.process_time() - cpu
            if not direct:
                _drop_page_cache([path], drop_caches)
            start = time.perf_counter()
            list(pool.map(read, range(count)))
            read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "baseline_write_gbps": nbytes / write_s / 1e9,
        "baseline_read_gbps": nbytes / read_s / 1e9,
        "baseline_write_cpu_s_per_gb": write_cpu / (nbytes / 1e9),
    }


def _vllm_fs_round(region: SharedRegion, directory: str, drop_caches: bool) -> dict[str, float] | None:
    """vLLM 0.33's fs tier I/O path on the same bytes, when vLLM imports; else None.

    Its own per-job functions (``batch_store_block``/``batch_load_block``: O_DIRECT when its
    probe allows, temp file + rename, no fsync) on its own thread pool with its default 16
    load + 16 store threads, one task per job of JOB_BLOCKS blocks, as its manager submits
    them; files named as its FileMapper names them. The manager's bookkeeping is not run.
    """
    try:
        from vllm.v1.kv_offload.tiering.fs import io as vllm_io
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
    except Exception:  # noqa: BLE001 - vLLM absent or not importable here: no such baseline
        return None
    count = region.num_rows
    view = memoryview(region.rows)  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
    offsets = [i * region.row_stride for i in range(count)]
    root = tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=directory)
    hashes = [xxhash.xxh3_128_hexdigest(b"vllm" + i.to_bytes(8, "little")) for i in range(count)]
    paths = [os.path.join(root, "kv_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin") for h in hashes]
    use_o_direct = vllm_io.probe_o_direct(root)
    pool = DualQueueThreadPool(16, 16, thread_name_prefix="bench_vllm_fs")
    try:

        def timed(load: bool) -> float:
            function = vllm_io.batch_load_block if load else vllm_io.batch_store_block
            start = time.perf_counter()
            for job_id, first in enumerate(range(0, count, JOB_BLOCKS)):
                task = partial(
                    function,
                    paths[first : first + JOB_BLOCKS],
                    view,
                    offsets[first : first + JOB_BLOCKS],
                    BLOCK_BYTES,
                    use_o_direct,
                )
                (pool.enqueue_load if load else pool.enqueue_store)(job_id, 1, [task])
            pool.wait_idle()
            seconds = time.perf_counter() - start
            if not all(success for _, success, _ in pool.get_finished()):
                raise RuntimeError("vLLM's fs tier failed a job")
            return seconds

        write_s = timed(False)
        if not use_o_direct:
            _drop_page_cache(_store_files(root), drop_caches)
        read_s = timed(True)
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    nbytes = count * BLOCK_BYTES
    return {"vllm_fs_write_gbps": nbytes / write_s / 1e9, "vllm_fs_read_gbps": nbytes / read_s / 1e9}


def _open_time(kind: str, directory: str, threads: int, blocks: int, drop_caches: bool) -> dict[str, Any]:
    """Build a store of ``blocks`` blocks through the backend, then time reopening it."""
    region = SharedRegion.create(1024, OPEN_BLOCK_BYTES)
    path = tempfile.mkdtemp(prefix=f"kvtier-bench-open-{kind}-", dir=directory)
    fingerprint = LayoutFingerprint.standalone(OPEN_BLOCK_BYTES)
    config = DiskTierConfig(
        name="bench-open",
        kind=kind,
        capacity_bytes=blocks * on_disk_block_bytes(OPEN_BLOCK_BYTES),
        path=path,
        fsync="none",
    )
    try:
        region.rows[:] = np.random.default_rng(1).integers(0, 256, region.rows.shape, dtype=np.uint8)
        keys = _keys(blocks, b"open")
        tier = open_store(config, region.rows, fingerprint, field="bench", threads=threads)
        try:
            start = time.perf_counter()
            for job_index, first in enumerate(range(0, blocks, 256)):
                chunk = keys[first : first + 256]
                tier.submit_store(
                    TierJob(job_index, tuple(chunk), tuple(i % 1024 for i in range(len(chunk))))
                )
                if job_index % 16 == 15:
                    tier.drain_jobs()
                    tier.get_finished_jobs()
            tier.drain_jobs()
            tier.get_finished_jobs()
            build_s = time.perf_counter() - start
        finally:
            tier.close()
        figures: dict[str, Any] = {"open_blocks_build_s": build_s}
        for label in ("open_s", "open_cold_s"):
            if label == "open_cold_s" and (not drop_caches or _drop_page_cache([]) != "drop_caches"):
                figures[label] = None
                continue
            start = time.perf_counter()
            tier = open_store(config, region.rows, fingerprint, field="bench", threads=threads)
            figures[label] = time.perf_counter() - start
            indexed = tier.num_blocks()
            tier.close()
            if indexed != blocks:
                raise RuntimeError(f"reopened with {indexed} blocks indexed, expected {blocks}")
        figures["open_blocks"] = blocks
        return figures
    finally:
        shutil.rmtree(path, ignore_errors=True)
        region.close()


def run(
    *,
    backend: str,
    gib: float = 2.0,
    threads: int | None = None,
    directory: str | None = None,
    rounds: int = 5,
    open_blocks: int = OPEN_BLOCKS,
    drop_caches: bool = True,
    fsync: str = "batch",
    secrets: bool = False,
    out: TextIO,
) -> dict[str, Any]:
    """Run the benchmark for ``backend`` (``lmdb`` or ``files``); print the table; the JSON record.

    ``open_blocks``: size of the store whose open is timed (0: skip that measurement).
    ``drop_caches``: may empty the machine's page cache (root) for cold reads and opens.
    ``fsync``: the tier's policy for the write phase (``batch``, the default, is durable per job;
    vLLM's fs tier never flushes, so ``none`` is its like-for-like), or :data:`FSYNC_AT_END`
    (durable once at the end, as the baseline).
    ``secrets``: also the keyed and encrypted tier, side by side (module docstring).
    Blocks the caller for the whole run (about a minute with the defaults).
    """
    directory = os.path.abspath(directory or default_directory())
    if not os.path.isdir(directory):
        raise ConfigError(
            "--dir",
            directory,
            "an existing directory on the disk to measure",
            f"create it first (mkdir -p {directory}), or leave --dir out for {default_directory()}",
        )
    threads = threads or DEFAULT_THREADS
    load_before = os.getloadavg()[0]
    count = max(JOB_BLOCKS, int(gib * (1 << 30)) // BLOCK_BYTES)
    region = SharedRegion.create(count, BLOCK_BYTES)
    try:
        rows = region.rows
        base = np.random.default_rng(0).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
        for i in range(count):
            rows[i] = base
            rows[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        sums = [xxhash.xxh3_64_intdigest(rows[i]) for i in range(count)]
        samples: list[dict[str, Any]] = []
        secret_dir = secret_file = None
        if secrets:
            secret_dir, secret_file = make_bench_secret()
        variants = secret_variants(secret_file)
        tiers: list[tuple[str, dict[str, Any]]] = [("plain", {}), *variants]
        baseline: dict[str, Any] = {}
        for round_index in range(rounds):
            # the plain tier and its variants in an order that rotates between rounds (the
            # run after another meets the disk busy with the deletion of the last store)
            turn = round_index % len(tiers)
            load = os.getloadavg()[0]
            if round_index % 2 == 0:
                baseline = _baseline_round(region, directory, threads, drop_caches)
            runs = {
                name: _kvtier_round(backend, region, directory, threads, sums, drop_caches, fsync, **options)
                for name, options in tiers[turn:] + tiers[:turn]
            }
            if round_index % 2 == 1:
                baseline = _baseline_round(region, directory, threads, drop_caches)
            measured = runs["plain"]
            sample = {**measured, **baseline}
            for name, _ in variants:
                keyed = runs[name]
                for phase in ("write", "read"):
                    sample[f"{name}_{phase}_gbps"] = keyed[f"{phase}_gbps"]
                    sample[f"{name}_{phase}_cost"] = 1 - keyed[f"{phase}_gbps"] / measured[f"{phase}_gbps"]
                    sample[f"{name}_{phase}_extra_cpu_s_per_gb"] = (
                        keyed[f"{phase}_cpu_s_per_gb"] - measured[f"{phase}_cpu_s_per_gb"]
                    )
            vllm_fs = _vllm_fs_round(region, directory, drop_caches)
            samples.append({**sample, **(vllm_fs or {}), "load": load})
    finally:
        region.close()
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
    names = [
        "write_gbps",
        "read_gbps",
        "full_write_gbps",
        "baseline_write_gbps",
        "baseline_read_gbps",
        "write_cpu_s_per_gb",
        "read_cpu_s_per_gb",
        "baseline_write_cpu_s_per_gb",
    ]
    if "vllm_fs_write_gbps" in samples[0]:
        names += ["vllm_fs_write_gbps", "vllm_fs_read_gbps"]
    for name, _ in variants:
        names += [
            f"{name}_{phase}_{what}"
            for phase in ("write", "read")
            for what in ("gbps", "cost", "extra_cpu_s_per_gb")
        ]
    figures = {name: median(sample[name] for sample in samples) for name in names}
    # Ratios pair each round's kvtier figure with that round's baseline, then take the median:
    # the disk's speed drifts by +-25% over a minute here, and pairing cancels the drift that a
    # ratio of two medians (taken from different rounds) would keep.
    for sample in samples:
        sample["write_ratio"] = sample["write_gbps"] / sample["baseline_write_gbps"]
        sample["read_ratio"] = sample["read_gbps"] / sample["baseline_read_gbps"]
        sample["full_write_ratio"] = sample["full_write_gbps"] / sample["baseline_write_gbps"]
    spread = {
        f"{name}_range": [min(s[name] for s in samples), max(s[name] for s in samples)]
        for name in ("write_ratio", "read_ratio", "full_write_ratio", "load")
    }
    record: dict[str, Any] = {
        "bench": "disk",
        "backend": backend,
        **figures,
        "write_ratio": median(sample["write_ratio"] for sample in samples),
        "read_ratio": median(sample["read_ratio"] for sample in samples),
        "full_write_ratio": median(sample["full_write_ratio"] for sample in samples),
        **spread,
        "load_before": load_before,
        "gib": count * BLOCK_BYTES / (1 << 30),
        "block_bytes": BLOCK_BYTES,
        "threads": threads,
        "rounds": rounds,
        "fsync": fsync,
        "o_direct": samples[-1]["o_direct"],
        "cold_read_method": samples[-1]["cold_read_method"],
        "dir": directory,
        "filesystem": _filesystem(directory),
        "samples": [
            {k: v for k, v in s.items() if k.endswith(("gbps", "ratio", "cost", "_gb", "load"))}
            for s in samples
        ],
        "secrets": [name for name, _ in variants],
        # "measured": vLLM's fs tier ran in this run (vllm_fs_*_gbps); else its reference figures
        "vllm_fs": "measured" if "vllm_fs_write_gbps" in figures else "reference",
        "vllm_fs_reference": VLLM_FS_REFERENCE,
    }
    if open_blocks:
        record.update(_open_time(backend, directory, threads, open_blocks, drop_caches))
    measured_vllm = record["vllm_fs"] == "measured"
    table = [
        {
            "phase": "write",
            "kvtier_gbps": figures["write_gbps"],
            "baseline_gbps": figures["baseline_write_gbps"],
            "ratio": record["write_ratio"],
            "ratio_range": "{:.2f}-{:.2f}".format(*record["write_ratio_range"]),
            "vllm_fs_gbps": figures["vllm_fs_write_gbps"] if measured_vllm else "2.6-3.3 (ref)",
        },
        {
            "phase": "write (full)",
            "kvtier_gbps": figures["full_write_gbps"],
            "baseline_gbps": figures["baseline_write_gbps"],
            "ratio": record["full_write_ratio"],
            "ratio_range": "{:.2f}-{:.2f}".format(*record["full_write_ratio_range"]),
            "vllm_fs_gbps": "",
        },
        {
            "phase": "read (cold)",
            "kvtier_gbps": figures["read_gbps"],
            "baseline_gbps": figures["baseline_read_gbps"],
            "ratio": record["read_ratio"],
            "ratio_range": "{:.2f}-{:.2f}".format(*record["read_ratio_range"]),
            "vllm_fs_gbps": figures["vllm_fs_read_gbps"] if measured_vllm else "0.5-1.7 (ref)",
        },
    ]
    print(
        f"kvtier bench disk: backend {backend}, {record['gib']:.2f} GiB as 2 MiB blocks, {threads} threads, "
        f"{rounds} rounds (medians), fsync {fsync}, {directory} ({record['filesystem']}), O_DIRECT "
        f"{'on' if record['o_direct'] else 'off'}, cold reads by {record['cold_read_method']}",
        file=out,
    )
    print_table(table, ["phase", "kvtier_gbps", "baseline_gbps", "ratio", "ratio_range", "vllm_fs_gbps"], out)
    print(
        "load average {:.1f} before, {:.1f}-{:.1f} over the rounds; CPU per GB written: kvtier {:.3f} s, "
        "baseline {:.3f} s".format(
            load_before,
            *record["load_range"],
            figures["write_cpu_s_per_gb"],
            figures["baseline_write_cpu_s_per_gb"],
        ),
        file=out,
    )
    if variants:
        print_table(
            [
                {
                    "tier": name,
                    "phase": phase,
                    "gbps": figures[f"{name}_{phase}_gbps"],
                    "plain_gbps": figures[f"{phase}_gbps"],
                    "cost": figures[f"{name}_{phase}_cost"],
                    "plain_cpu_s/GB": figures[f"{phase}_cpu_s_per_gb"],
                    "extra_cpu_s/GB": figures[f"{name}_{phase}_extra_cpu_s_per_gb"],
                }
                for name, _ in variants
                for phase in ("write", "read")
            ],
            ["tier", "phase", "gbps", "plain_gbps", "cost", "plain_cpu_s/GB", "extra_cpu_s/GB"],
            out,
        )
    if open_blocks:
        cold = record["open_cold_s"]
        print(
            f"open with {open_blocks} blocks indexed: open_s {record['open_s']:.3f}"
            + (
                f", open_cold_s {cold:.3f}"
                if cold is not None
                else ", open_cold_s not measured (needs root, and no --no-drop-caches)"
            ),
            file=out,
        )
    return record

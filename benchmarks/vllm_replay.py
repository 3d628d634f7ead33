"""A Mooncake trace through vLLM 0.33's own tiering offloader: the vLLM side of the comparison
with ``kvtier replay`` (docs/results.md, "Replay against vLLM's tiering stack").

    scripts/vllm-cpu-env.sh /tmp/kvtier-vllm-env -e .     # once: vLLM 0.33 on a CPU machine
    /tmp/kvtier-vllm-env/bin/python benchmarks/vllm_replay.py [TRACE] [--gpu-blocks 2000]
        [--cpu-blocks 8000] [--block-bytes 4096] [--limit N] [--fs-threads 16] [--poll-us 100]
        [--retry-timeout 10] [--scratch /tmp/vreplay] [--keep-fs] [--json]

TRACE is a Mooncake-format JSONL file or a bundled trace's name (default: the bundled
synthetic one), read by kvtier's own trace loader. The stack is vLLM's, built as the engine
builds it (``TieringOffloadingSpec(OffloadingConfig).get_manager()``): a CPU primary tier
(LRU) in a shared-memory region, and vLLM's ``fs`` secondary tier (a file per block, no
capacity, every stored block written through at ``complete_store``, read back by promotion).
No GPU and no vLLM worker: this script plays the connector's scheduler side and the worker's
copies, moving real bytes in and out of the primary region, with the engine model ``kvtier
replay`` uses, so the two are compared on the same work:

* a block per trace id: key ``make_offload_key(sha256(str(id)), 0)``, payload the digest
  repeated to ``--block-bytes``, so every load is checked byte for byte;
* a GPU prefix cache of ``--gpu-blocks`` ids (LRU); requests in trace order, one per step;
* per request: the GPU prefix; then lookups of the rest in order, stopping at the first MISS
  and going on past RETRY / HIT_PENDING, as the connector's prefix scan does; a deferred
  request runs empty steps (``on_schedule_end``, where vLLM polls its jobs) every
  ``--poll-us`` until each answer is HIT or MISS or ``--retry-timeout`` passes; the leading
  HITs are loaded (a copy out of the region, verified), the rest computed and stored (a copy
  into the slots ``prepare_store`` gives; when it gives none, empty steps until it does,
  as the connector retries); ``on_request_finished``, then the step's end;
* at the end, empty steps until no job is in flight (in ``elapsed_s``, and alone as ``drain_s``).

A hit is ``cpu`` when every answer its key got was HIT, ``fs`` when it waited for a
promotion. Prints a table, then one JSON line: ``impl``, ``trace``, ``requests``,
``block_refs``, ``ceiling_hit_ratio``, ``hit_ratio``, ``hits`` (gpu, cpu, fs),
``promotions``, ``bytes_written_fs``, ``verified_blocks``, ``corrupt_blocks``,
``retry_timeouts``, ``elapsed_s``, ``block_refs_per_s``, and diagnostics (``fs_files``,
vLLM's read and write byte counters, ``dropped_blocks``, ``store_stalls``, ``wait_steps``,
``lookup_wait_s``, job failure counters, ``drain_s``, ``config``). Exit 1 if a loaded block
was wrong.

vLLM's fs tier answers a key it has not checked yet with RETRY and checks on its own thread
after the step, so every block outside the CPU tier costs at least one empty step: the
elapsed time depends on ``--poll-us`` and the GIL, the hit counts do not. On a machine
without CUDA vLLM's fs tier does its file I/O in Python. The code is kvtier's; it calls vLLM
(Apache-2.0) only through its public kv_offload API.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from typing import Any

from kvtier.bench.manager_stack import vllm_tiering_config
from kvtier.bench.report import print_json, print_table
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, bundled_trace_path, ceiling_hit_ratio, load_trace

IMPL = "vllm-0.33-tiering"
#: requests between two drains of vLLM's statistics (it drains once per step when logging)
STATS_EVERY = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="JSONL trace or a bundled trace's name (default: synthetic)")
    parser.add_argument("--gpu-blocks", type=int, default=2000, help="the GPU prefix cache, in blocks")
    parser.add_argument("--cpu-blocks", type=int, default=8000, help="vLLM's CPU primary tier, in blocks")
    parser.add_argument("--block-bytes", type=int, default=4096, help="payload bytes per block")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--fs-threads", type=int, default=16, help="fs tier read and write threads each")
    parser.add_argument("--scratch", default="/tmp/vreplay", help="where the fs tier's fresh root goes")
    parser.add_argument(
        "--poll-us", type=float, default=100.0, help="sleep between a deferred request's empty steps"
    )
    parser.add_argument(
        "--retry-timeout", type=float, default=10.0, help="the longest a request waits, in seconds"
    )
    parser.add_argument("--keep-fs", action="store_true", help="keep the fs tier's root at the end")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    for name in ("gpu_blocks", "cpu_blocks", "block_bytes", "fs_threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def payload_of(digest: bytes, block_bytes: int) -> bytes:
    """A block's bytes: its key's digest, repeated to ``block_bytes``."""
    return (digest * (block_bytes // len(digest) + 1))[:block_bytes]


def tree_usage(root: str) -> tuple[int, int]:
    """(bytes of every file under ``root``, how many of them are ``.bin`` blocks)."""
    total = blocks = 0
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                continue
            blocks += name.endswith(".bin")
    return total, blocks


def build_stack(args: argparse.Namespace, fs_root: str) -> Any:
    """vLLM's tiering spec over a CPU tier of exactly ``--cpu-blocks`` rows and an fs tier."""
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    # vLLM sizes the tier as cpu_bytes_to_use // row, a row being the block rounded up to pages
    row = round_up(args.block_bytes, TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": args.cpu_blocks * row,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": fs_root,
                "n_read_threads": args.fs_threads,
                "n_write_threads": args.fs_threads,
            }
        ],
    }
    config = vllm_tiering_config(
        extra, tokens_per_block=TRACE_BLOCK_TOKENS, block_bytes=args.block_bytes, name="vreplay"
    )
    spec = TieringOffloadingSpec(config)
    assert spec.num_chunks == args.cpu_blocks and spec.kv_bytes_per_chunk == row
    return spec, row


class Replay:
    """One run: the manager, the primary region's bytes, the GPU cache and the counts."""

    def __init__(self, args: argparse.Namespace, manager: Any, row: int):
        from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext
        from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as Metrics

        self.args, self.manager, self.row = args, manager, row
        self.hit, self.miss = LookupResult.HIT, LookupResult.MISS
        self.step_context = ScheduleEndContext
        self.empty_step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        view = manager.primary_tier.get_kv_memoryview()  # (rows, row bytes) over the region
        assert view.strides[0] == row
        self.region = view.cast("B")  # row r is region[r * row : r * row + block_bytes]
        self.vllm_counts = dict.fromkeys(
            (
                Metrics.READ_BYTES,
                Metrics.WRITE_BYTES,
                Metrics.PROMOTION_JOB_FAILURES,
                Metrics.CASCADE_JOB_FAILURES,
                Metrics.PROMOTION_ALLOCATION_FAILURES,
            ),
            0,
        )
        self.gpu: OrderedDict[int, bytes] = OrderedDict()
        self.keys: dict[int, bytes] = {}
        self.hits = {"gpu": 0, "cpu": 0, "fs": 0}
        self.verified = self.corrupt = self.retry_timeouts = 0
        self.store_stalls = self.dropped = self.wait_steps = 0
        self.lookup_wait_s = 0.0

    def drain_stats(self) -> None:
        """Add vLLM's statistics since the last drain (caller holds the manager's lock)."""
        stats = self.manager.get_stats()
        if stats is None:
            return
        _, values = stats.metric_sections()
        for name in self.vllm_counts:
            self.vllm_counts[name] += sum(values.get(name, {}).values())

    def key_of(self, block_id: int) -> bytes:
        from vllm.v1.kv_offload.base import make_offload_key

        key = self.keys.get(block_id)
        if key is None:
            key = self.keys[block_id] = make_offload_key(hashlib.sha256(str(block_id).encode()).digest(), 0)
        return key

    def lookup(self, keys: list[bytes], context: Any) -> tuple[int, int]:
        """The leading hits of ``keys`` once every answer is HIT or MISS: (hits, of them
        promoted from the fs tier)."""
        waited = bytearray(len(keys))  # 1: the key got an answer other than HIT
        lock, deadline, started = self.manager.lock, None, 0.0
        while True:
            with lock:
                deferred, lead, open_run = False, 0, True
                for i, key in enumerate(keys):
                    answer = self.manager.lookup(key, context)
                    if answer is self.hit:
                        lead += open_run
                    elif answer is self.miss:
                        break
                    else:  # RETRY or HIT_PENDING: the scan goes on, the request waits a step
                        deferred, open_run, waited[i] = True, False, 1
                if not deferred:
                    break
                now = time.monotonic()
                if deadline is None:
                    deadline, started = now + self.args.retry_timeout, time.perf_counter()
                elif now > deadline:
                    self.retry_timeouts += 1
                    break
                self.manager.on_schedule_end(self.empty_step)
            self.wait_steps += 1
            time.sleep(self.args.poll_us / 1e6)
        if deadline is not None:
            self.lookup_wait_s += time.perf_counter() - started
        return lead, sum(waited[:lead])

    def store(self, keys: list[bytes], context: Any) -> dict[bytes, bytes]:
        """Compute ``keys`` and store what vLLM takes; their payloads by key."""
        lock, bytes_ = self.manager.lock, self.args.block_bytes
        computed = {key: payload_of(key[:-4], bytes_) for key in keys}
        with lock:
            out = self.manager.prepare_store(keys, context)
        deadline = time.monotonic() + self.args.retry_timeout
        while out is None:  # every slot held by jobs in flight: retry on later steps
            self.store_stalls += 1
            with lock:
                self.manager.on_schedule_end(self.empty_step)
                futile = not self.manager.has_pending_work()  # nothing in flight can free one
            if futile or time.monotonic() > deadline:
                self.dropped += len(keys)
                return computed
            time.sleep(self.args.poll_us / 1e6)
            with lock:
                out = self.manager.prepare_store(keys, context)
        if out.keys_to_store:
            for key, row in zip(out.keys_to_store, out.store_spec.block_ids.tolist()):
                self.region[row * self.row : row * self.row + bytes_] = computed[key]
            with lock:
                self.manager.complete_store(out.keys_to_store, context)
        return computed

    def request(self, number: int, ids: tuple[int, ...]) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        keys = [self.key_of(block_id) for block_id in ids]
        name = f"req-{number}"
        context = ReqContext(req_id=name)
        for position, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, position * TRACE_BLOCK_TOKENS)
        on_gpu = 0
        while on_gpu < len(ids) and ids[on_gpu] in self.gpu:
            on_gpu += 1
        self.hits["gpu"] += on_gpu
        rest = keys[on_gpu:]
        with self.manager.lock:
            self.manager.on_new_request(context)
        lead, promoted = self.lookup(rest, context) if rest else (0, 0)
        self.hits["fs"] += promoted
        self.hits["cpu"] += lead - promoted
        loaded = []
        if lead:
            with self.manager.lock:
                spec = self.manager.prepare_load(rest[:lead], context)
            for key, row in zip(rest[:lead], spec.block_ids.tolist()):
                block = bytes(self.region[row * self.row : row * self.row + self.args.block_bytes])
                if block == payload_of(key[:-4], self.args.block_bytes):
                    self.verified += 1
                else:
                    self.corrupt += 1
                loaded.append(block)
            with self.manager.lock:
                self.manager.complete_load(rest[:lead], context)
        computed = self.store(rest[lead:], context) if rest[lead:] else {}
        for index, block_id in enumerate(ids):  # the GPU cache: every id, most recent last
            if index >= on_gpu:
                self.gpu[block_id] = (
                    loaded[index - on_gpu] if index < on_gpu + lead else computed[keys[index]]
                )
            self.gpu.move_to_end(block_id)
        while len(self.gpu) > self.args.gpu_blocks:
            self.gpu.popitem(last=False)
        with self.manager.lock:
            self.manager.on_request_finished(context)
            self.manager.on_schedule_end(self.step_context(new_req_ids=(name,), preempted_req_ids=()))
            if (number + 1) % STATS_EVERY == 0:
                self.drain_stats()

    def drain(self) -> None:
        """Empty steps until no job is in flight (at most ten minutes)."""
        deadline = time.monotonic() + 600.0
        while True:
            with self.manager.lock:
                self.manager.on_schedule_end(self.empty_step)
                busy = self.manager.has_pending_work()
            if not busy:
                break
            if time.monotonic() > deadline:
                print("vllm_replay: vLLM's manager still busy after 600 s", file=sys.stderr)
                break
            time.sleep(max(self.args.poll_us / 1e6, 1e-4))
        with self.manager.lock:
            self.drain_stats()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as Metrics

    trace = args.trace or str(bundled_trace_path())
    requests = load_trace(trace, args.limit)
    ceiling, refs = ceiling_hit_ratio(requests)
    os.makedirs(args.scratch, exist_ok=True)
    fs_root = tempfile.mkdtemp(prefix="vllm_fs_", dir=args.scratch)
    manager = replay = None
    try:
        spec, row = build_stack(args, fs_root)
        manager = spec.get_manager()
        replay = Replay(args, manager, row)
        print(
            f"vllm_replay: {IMPL}, {len(requests)} requests of {trace}; gpu {args.gpu_blocks}, "
            f"cpu {args.cpu_blocks} blocks of {args.block_bytes} B (rows of {row} B), fs root {fs_root}",
            file=sys.stderr,
        )
        start = time.perf_counter()
        for number, request in enumerate(requests):
            replay.request(number, request.hash_ids)
        drain_start = time.perf_counter()
        replay.drain()
        elapsed = time.perf_counter() - start
        fs_bytes, fs_files = tree_usage(fs_root)
        counts = replay.vllm_counts
        return {
            "impl": IMPL,
            "trace": os.path.basename(trace),
            "requests": len(requests),
            "block_refs": refs,
            "ceiling_hit_ratio": round(ceiling, 6),
            "hit_ratio": round(sum(replay.hits.values()) / refs, 6) if refs else 0.0,
            "hits": dict(replay.hits),
            "promotions": int(counts[Metrics.READ_BYTES] // row),
            "bytes_written_fs": fs_bytes,
            "verified_blocks": replay.verified,
            "corrupt_blocks": replay.corrupt,
            "retry_timeouts": replay.retry_timeouts,
            "elapsed_s": round(elapsed, 3),
            "block_refs_per_s": round(refs / elapsed, 1) if elapsed > 0 else None,
            "fs_files": fs_files,
            "fs_write_bytes": int(counts[Metrics.WRITE_BYTES]),
            "fs_read_bytes": int(counts[Metrics.READ_BYTES]),
            "dropped_blocks": replay.dropped,
            "store_stalls": replay.store_stalls,
            "wait_steps": replay.wait_steps,
            "lookup_wait_s": round(replay.lookup_wait_s, 3),
            "promotion_alloc_failures": int(counts[Metrics.PROMOTION_ALLOCATION_FAILURES]),
            "promotion_job_failures": int(counts[Metrics.PROMOTION_JOB_FAILURES]),
            "cascade_job_failures": int(counts[Metrics.CASCADE_JOB_FAILURES]),
            "drain_s": round(time.perf_counter() - drain_start, 3),
            "config": {
                "gpu_blocks": args.gpu_blocks,
                "cpu_blocks": args.cpu_blocks,
                "block_bytes": args.block_bytes,
                "row_bytes": row,
                "fs_threads": args.fs_threads,
                "poll_us": args.poll_us,
                "retry_timeout_s": args.retry_timeout,
                "limit": args.limit,
            },
        }
    finally:
        if replay is not None:
            replay.region.release()
        try:
            if manager is not None:
                manager.shutdown()  # stops the fs threads, unmaps and removes the region
        finally:
            if not args.keep_fs:
                shutil.rmtree(fs_root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    record = run(args)
    if not args.json:
        rows = [
            {
                "tier": tier,
                "hits": hits,
                "hit_ratio": hits / record["block_refs"] if record["block_refs"] else 0.0,
            }
            for tier, hits in record["hits"].items()
        ]
        print(
            f"{IMPL}: {record['requests']} requests, {record['block_refs']} block refs, "
            f"{record['elapsed_s']} s ({record['block_refs_per_s']} block refs/s); hit ratio "
            f"{record['hit_ratio']} of a {record['ceiling_hit_ratio']} ceiling"
        )
        print_table(rows, ["tier", "hits", "hit_ratio"], sys.stdout)
    print_json(record, sys.stdout)
    return 1 if record["corrupt_blocks"] else 0


if __name__ == "__main__":
    sys.exit(main())

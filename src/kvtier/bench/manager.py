"""``kvtier bench manager``: scheduler-side cost of the single-tier manager, per block.

Protocol (the same for kvtier and the baseline, for each policy and each batch size):

1. store: 100,000 distinct keys offered as requests of ``keys_per_call`` keys into a tier of
   50,000 blocks (so half the stores evict); a request is on_new_request, prepare_store,
   complete_store, on_request_finished, on_schedule_end;
2. lookup: one lookup per key, all 100,000;
3. load: the resident keys, request by request: prepare_load, complete_load,
   on_request_finished, on_schedule_end.

Per-block figures are the median of ``--runs`` runs. ``metadata_bytes_per_block`` is what
tracemalloc sees a fresh manager allocate while it takes 50,000 blocks (keys made by the caller
beforehand; the shared-memory rows are not Python allocations and are not counted);
``..._incl_keys`` also counts the key objects, for a manager that ends up their only owner.

The baseline is vLLM's own CPU manager (``vllm.v1.kv_offload.cpu.manager``) driven the same way
in the same run, when vLLM imports (docs/bench.md shows a CPU-only vLLM environment). Without
vLLM, the figures the kvtier issue tracker measured for vLLM 0.33 on this machine kind are shown
as the baseline instead, and the JSON says ``"baseline": "reference"``.
"""

from __future__ import annotations

import gc
import hashlib
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any, TextIO

from kvtier.bench.report import print_json, print_table

# vLLM 0.33's CPU manager on this machine kind, driven by this protocol (from issue #2).
VLLM_REFERENCE: dict[tuple[str, int], dict[str, float]] = {
    ("lru", 64): {"store_us": 5.1, "lookup_us": 0.34, "load_us": 4.3, "metadata_bytes_per_block": 586},
    ("arc", 64): {"store_us": 2.7, "lookup_us": 0.38, "load_us": 1.6, "metadata_bytes_per_block": 242},
    ("lru", 1): {"store_us": 20.0, "load_us": 14.0},
}
FIGURES = ("store_us", "lookup_us", "load_us", "metadata_bytes_per_block")
BLOCK_BYTES = 4096  # rows are never touched here; small keeps the shared region small


def make_keys(count: int, salt: bytes = b"") -> list[bytes]:
    """``count`` distinct 36-byte keys shaped like vLLM's (32-byte hash + 4-byte group)."""
    return [hashlib.sha256(salt + i.to_bytes(8, "little")).digest() + b"\0\0\0\0" for i in range(count)]


@dataclass
class Subject:
    """One manager implementation under test."""

    name: str
    make_manager: Callable[[str, int], Any]  # (policy, capacity_blocks) -> manager
    make_context: Callable[[str], Any]  # req_id -> request context
    end_step: Callable[[Any], None]  # manager -> None: its on_schedule_end, as its API wants it


def kvtier_subject(shm_dir: str) -> Subject:
    from kvtier.base import ReqContext
    from kvtier.build import build_manager

    counter = iter(range(1 << 30))

    def make(policy: str, capacity_blocks: int) -> Any:
        tier = {
            "kind": "cpu",
            "capacity": capacity_blocks * BLOCK_BYTES,
            "eviction": policy,
            "path": f"{shm_dir}/bench-{next(counter)}",
            "pin_memory": "off",
        }
        return build_manager({"tiers": [tier]}, BLOCK_BYTES, enable_events=False)

    return Subject("kvtier", make, ReqContext, lambda manager: manager.on_schedule_end())


def vllm_subject() -> Subject | None:
    try:
        from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
        from vllm.v1.kv_offload.base import ScheduleEndContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except Exception:  # any import failure means: no vLLM here
        return None

    def make(policy: str, capacity_blocks: int) -> Any:
        return CPUOffloadingManager(capacity_blocks, cache_policy=policy, enable_events=False)

    # vLLM 0.33's on_schedule_end takes the step's new and preempted request ids.
    no_changes = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    return Subject("vllm", make, VllmReqContext, lambda manager: manager.on_schedule_end(no_changes))


def _chunks(keys: list[bytes], size: int) -> list[list[bytes]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


def run_once(
    subject: Subject, policy: str, keys_per_call: int, keys: list[bytes], capacity: int
) -> dict[str, float]:
    """One pass of the protocol; seconds per block for each phase."""
    manager = subject.make_manager(policy, capacity)
    end_step = subject.end_step
    requests = _chunks(keys, keys_per_call)
    contexts = [subject.make_context(f"req-{i}") for i in range(len(requests))]
    try:
        start = time.perf_counter()
        for chunk, ctx in zip(requests, contexts):
            manager.on_new_request(ctx)
            manager.prepare_store(chunk, ctx)
            manager.complete_store(chunk, ctx, True)
            manager.on_request_finished(ctx)
            end_step(manager)
        store_s = (time.perf_counter() - start) / len(keys)

        ctx = contexts[0]
        lookup = manager.lookup
        start = time.perf_counter()
        for key in keys:
            lookup(key, ctx)
        lookup_s = (time.perf_counter() - start) / len(keys)

        # vLLM answers LookupResult.HIT, kvtier True: keep whatever reads as a hit.
        resident = [k for k in keys if _is_hit(lookup(k, ctx))]
        load_requests = _chunks(resident, keys_per_call)
        load_contexts = [subject.make_context(f"load-{i}") for i in range(len(load_requests))]
        start = time.perf_counter()
        for chunk, ctx in zip(load_requests, load_contexts):
            manager.on_new_request(ctx)
            manager.prepare_load(chunk, ctx)
            manager.complete_load(chunk, ctx)
            manager.on_request_finished(ctx)
            end_step(manager)
        load_s = (time.perf_counter() - start) / max(1, len(resident))
        if len(resident) != capacity:
            raise RuntimeError(f"{subject.name}/{policy}: {len(resident)} resident, expected {capacity}")
    finally:
        manager.shutdown()
    return {"store_us": store_s * 1e6, "lookup_us": lookup_s * 1e6, "load_us": load_s * 1e6}


def _is_hit(answer: Any) -> bool:
    return answer is True or getattr(answer, "name", None) == "HIT"


def metadata_bytes(
    subject: Subject, policy: str, capacity: int, keys: list[bytes], keys_owned: bool
) -> float:
    """Bytes tracemalloc sees a fresh manager allocate while taking ``capacity`` blocks."""
    gc.collect()
    tracemalloc.start()
    try:
        held = [bytes(bytearray(k)) for k in keys[:capacity]] if keys_owned else keys[:capacity]
        manager = subject.make_manager(policy, capacity)
        # requests of 64 keys that start, store and finish, as the timed store phase's: what
        # is measured is what the manager keeps per block, not a request's state that an
        # engine would have let go (vLLM's and kvtier's alike keep keys per open request)
        for index, chunk in enumerate(_chunks(held, 64)):
            ctx = subject.make_context(f"mem-{index}")
            manager.on_new_request(ctx)
            manager.prepare_store(chunk, ctx)
            manager.complete_store(chunk, ctx, True)
            manager.on_request_finished(ctx)
            subject.end_step(manager)
        del held
        gc.collect()
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    manager.shutdown()
    return used / capacity


def run(
    *, num_keys: int = 100_000, capacity: int = 50_000, runs: int = 5, out: TextIO | None = None
) -> dict[str, Any]:
    """Run the whole benchmark; print the table and the JSON line; return the JSON record."""
    out = out or sys.stdout
    keys = make_keys(num_keys)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir="/dev/shm") as shm_dir:
        subjects = [kvtier_subject(shm_dir)]
        baseline = vllm_subject()
        if baseline is not None:
            subjects.append(baseline)
        for policy in ("lru", "arc"):
            for keys_per_call in (64, 1):
                measured: dict[str, dict[str, float]] = {}
                for subject in subjects:
                    samples = [run_once(subject, policy, keys_per_call, keys, capacity) for _ in range(runs)]
                    figures = {phase: median(s[phase] for s in samples) for phase in samples[0]}
                    figures["metadata_bytes_per_block"] = metadata_bytes(
                        subject, policy, capacity, keys, False
                    )
                    figures["metadata_bytes_per_block_incl_keys"] = metadata_bytes(
                        subject, policy, capacity, keys, True
                    )
                    measured[subject.name] = figures
                base = measured.get("vllm") or VLLM_REFERENCE.get((policy, keys_per_call), {})
                row: dict[str, Any] = {"policy": policy, "keys_per_call": keys_per_call, **measured["kvtier"]}
                for fig in FIGURES:
                    if fig in base:
                        row[f"baseline_{fig}"] = base[fig]
                        row[f"speedup_{fig}"] = base[fig] / row[fig] if row[fig] else None
                rows.append(row)

    record = {
        "bench": "manager",
        "baseline": "vllm" if baseline is not None else "reference",
        "num_keys": num_keys,
        "capacity_blocks": capacity,
        "runs": runs,
        "rows": rows,
    }
    print(
        f"kvtier bench manager: {num_keys} keys into {capacity} blocks, median of {runs} runs; "
        f"baseline = {'vLLM measured now' if baseline else 'vLLM 0.33 reference figures (vllm not importable)'}",
        file=out,
    )
    columns = ["policy", "keys_per_call"]
    for fig in FIGURES:
        columns += [fig, f"baseline_{fig}", f"speedup_{fig}"]
    print_table(rows, columns, out)
    print_json(record, out)
    return record

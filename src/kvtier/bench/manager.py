"""``kvtier bench manager``: scheduler-side cost of the single-tier manager, per block.

Protocol (the same for kvtier and the baseline, for each policy and each batch size):

1. store: 100,000 distinct keys offered as requests of ``keys_per_call`` keys into a tier of
   50,000 blocks (so half the stores evict); a request is on_new_request, prepare_store,
   complete_store, on_request_finished, on_schedule_end;
2. lookup: one lookup per key, all 100,000 (half hit, half miss);
3. load: the resident keys, request by request: prepare_load, complete_load,
   on_request_finished, on_schedule_end.

kvtier runs with its default configuration, miss causes on. Work a manager defers (kvtier's
miss-cause log, applied in batches) is done inside the phase that made it: each timed phase
ends by settling it, as reading the counters would.

Times are CPU seconds of this process (``time.process_time``), not wall time: on a machine
shared with other jobs, time spent waiting for a core is not the manager's. Each round runs
kvtier and the baseline back to back, in an order that alternates between rounds; a figure
is the median over ``--runs`` rounds, a speedup the median of the rounds' own ratios (the
baseline's time over kvtier's), with the lowest and highest ratio beside it as its noise.

``metadata_bytes_per_block`` is what tracemalloc sees a fresh manager allocate while it takes
50,000 blocks (keys made by the caller beforehand; the shared-memory rows are not Python
allocations and are not counted); ``..._incl_keys`` also counts the key objects, for a manager
that ends up their only owner. Its speedup is the baseline's bytes over kvtier's.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from statistics import median
from typing import Any, TextIO

from kvtier.bench.report import print_table

# vLLM 0.33's CPU manager on this machine kind, driven by this protocol (from issue #2).
VLLM_REFERENCE: dict[tuple[str, int], dict[str, float]] = {
    ("lru", 64): {"store_us": 5.1, "lookup_us": 0.34, "load_us": 4.3, "metadata_bytes_per_block": 586},
    ("arc", 64): {"store_us": 2.7, "lookup_us": 0.38, "load_us": 1.6, "metadata_bytes_per_block": 242},
    ("lru", 1): {"store_us": 20.0, "load_us": 14.0},
}
FIGURES = ("store_us", "lookup_us", "load_us", "metadata_bytes_per_block")
#: what issue #32 asks of the default configuration: each time at least this multiple of
#: vLLM's speed, and at most this much metadata per block
GOAL_SPEEDUP = 2.0
GOAL_BYTES_PER_BLOCK = 200
BLOCK_BYTES = 4096  # rows are never touched here; small keeps the shared region small
_SWEEP_BYTES = 64 << 20  # more than any CPU's last-level cache this runs on (32 MiB here)


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
    # manager -> None: finish the work its calls deferred (kvtier's miss-cause log)
    settle: Callable[[Any], None] = lambda manager: None


def kvtier_subject(shm_dir: str, miss_causes: str = "on") -> Subject:
    """kvtier's single-tier manager over a CPU tier in ``shm_dir``, miss causes ``on`` (the
    default configuration) or ``off``."""
    from kvtier.base import ReqContext
    from kvtier.build import build_manager

    counter = iter(range(1 << 30))

    def make(policy: str, capacity_blocks: int) -> Any:
        tier = {
            "kind": "cpu",
            "capacity": capacity_blocks * BLOCK_BYTES,
            "eviction": policy,
            "path": f"{shm_dir}/bench-{miss_causes}-{next(counter)}",
            "pin_memory": "off",
        }
        config: dict[str, Any] = {"tiers": [tier]}
        if miss_causes == "off":
            config["miss_causes"] = "off"
        return build_manager(config, BLOCK_BYTES, enable_events=False)

    def settle(manager: Any) -> None:
        causes = manager.miss_causes
        if causes is not None:
            causes.flush()

    name = "kvtier" if miss_causes == "on" else f"kvtier, miss_causes {miss_causes}"
    return Subject(name, make, ReqContext, lambda manager: manager.on_schedule_end(), settle)


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
    """One pass of the protocol; CPU microseconds per block for each phase."""
    manager = subject.make_manager(policy, capacity)
    end_step, settle = subject.end_step, subject.settle
    requests = _chunks(keys, keys_per_call)
    contexts = [subject.make_context(f"req-{i}") for i in range(len(requests))]
    clock = time.process_time
    try:
        start = clock()
        _store(subject, manager, zip(requests, contexts))
        store_s = (clock() - start) / len(keys)

        ctx = contexts[0]
        lookup = manager.lookup
        start = clock()
        for key in keys:
            lookup(key, ctx)
        settle(manager)
        lookup_s = (clock() - start) / len(keys)

        # vLLM answers LookupResult.HIT, kvtier True: keep whatever reads as a hit.
        resident = [k for k in keys if _is_hit(lookup(k, ctx))]
        settle(manager)
        load_requests = _chunks(resident, keys_per_call)
        load_contexts = [subject.make_context(f"load-{i}") for i in range(len(load_requests))]
        start = clock()
        for chunk, ctx in zip(load_requests, load_contexts):
            manager.on_new_request(ctx)
            manager.prepare_load(chunk, ctx)
            manager.complete_load(chunk, ctx)
            manager.on_request_finished(ctx)
            end_step(manager)
        settle(manager)
        load_s = (clock() - start) / max(1, len(resident))
        if len(resident) != capacity:
            raise RuntimeError(f"{subject.name}/{policy}: {len(resident)} resident, expected {capacity}")
    finally:
        manager.shutdown()
    return {"store_us": store_s * 1e6, "lookup_us": lookup_s * 1e6, "load_us": load_s * 1e6}


def _store(subject: Subject, manager: Any, requests: Iterable[tuple[list[bytes], Any]]) -> None:
    """The store phase: each request (its keys, its context) starts, stores its keys and
    ends, a step each; then the manager settles."""
    end_step = subject.end_step
    for chunk, ctx in requests:
        manager.on_new_request(ctx)
        manager.prepare_store(chunk, ctx)
        manager.complete_store(chunk, ctx, True)
        manager.on_request_finished(ctx)
        end_step(manager)
    subject.settle(manager)


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
        chunks = enumerate(_chunks(held, 64))
        _store(subject, manager, ((chunk, subject.make_context(f"mem-{i}")) for i, chunk in chunks))
        del held
        gc.collect()
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    manager.shutdown()
    return used / capacity


def _spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


def run(
    *, num_keys: int = 100_000, capacity: int = 50_000, runs: int = 5, out: TextIO | None = None
) -> dict[str, Any]:
    """Run the whole benchmark; print the table; return the JSON record (the CLI prints it with --json)."""
    out = out or sys.stdout
    keys = make_keys(num_keys)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir="/dev/shm") as shm_dir:
        ours = kvtier_subject(shm_dir)
        baseline = vllm_subject()
        subjects = [ours] if baseline is None else [ours, baseline]
        for policy in ("lru", "arc"):
            for keys_per_call in (64, 1):
                samples: dict[str, list[dict[str, float]]] = {subject.name: [] for subject in subjects}
                for round_index in range(runs):
                    turn = subjects if round_index % 2 == 0 else subjects[::-1]
                    for subject in turn:
                        samples[subject.name].append(run_once(subject, policy, keys_per_call, keys, capacity))
                measured = {
                    name: {phase: median(s[phase] for s in taken) for phase in taken[0]}
                    for name, taken in samples.items()
                }
                for subject in subjects:
                    for owned in (False, True):
                        figure = "metadata_bytes_per_block" + ("_incl_keys" if owned else "")
                        measured[subject.name][figure] = metadata_bytes(
                            subject, policy, capacity, keys, owned
                        )
                row: dict[str, Any] = {"policy": policy, "keys_per_call": keys_per_call, **measured["kvtier"]}
                base = measured.get("vllm") or VLLM_REFERENCE.get((policy, keys_per_call), {})
                for fig in FIGURES:
                    if fig not in base:
                        continue
                    row[f"baseline_{fig}"] = base[fig]
                    if "vllm" in samples and fig != "metadata_bytes_per_block":
                        # each round's own ratio: the machine's speed drifts between rounds
                        ratios = [
                            theirs[fig] / mine[fig]
                            for mine, theirs in zip(samples["kvtier"], samples["vllm"])
                        ]
                        row[f"speedup_{fig}"] = median(ratios)
                        row[f"speedup_{fig}_range"] = _spread(ratios)
                    else:
                        row[f"speedup_{fig}"] = base[fig] / row[fig] if row[fig] else None
                rows.append(row)

    below = [
        f"{row['policy']}/{row['keys_per_call']} {fig}"
        for row in rows
        for fig in FIGURES
        if fig != "metadata_bytes_per_block" and (row.get(f"speedup_{fig}") or GOAL_SPEEDUP) < GOAL_SPEEDUP
    ] + [
        f"{row['policy']}/{row['keys_per_call']} metadata_bytes_per_block"
        for row in rows
        if row["metadata_bytes_per_block"] > GOAL_BYTES_PER_BLOCK
    ]
    from kvtier.manager.causes import speedups

    record: dict[str, Any] = {
        "bench": "manager",
        "baseline": "vllm" if baseline is not None else "reference",
        "config": "default (miss causes on)",
        # the lookup and the miss causes' hash and probe in C (kvtier._speedups), or Python
        "speedups": speedups is not None,
        "timer": "process_time",
        "num_keys": num_keys,
        "capacity_blocks": capacity,
        "runs": runs,
        "rows": rows,
        "goal_speedup": GOAL_SPEEDUP,
        "goal_bytes_per_block": GOAL_BYTES_PER_BLOCK,
        "below_goal": below,
    }
    print(
        f"kvtier bench manager: {num_keys} keys into {capacity} blocks, default config (miss causes "
        f"on{'' if speedups else '; kvtier._speedups not built: the Python path'}), CPU time, "
        f"median of {runs} alternating rounds; baseline = "
        f"{'vLLM measured now' if baseline else 'vLLM 0.33 reference figures (vllm not importable)'}",
        file=out,
    )
    table = []
    for row in rows:
        line = {"policy": row["policy"], "keys_per_call": row["keys_per_call"]}
        for fig in FIGURES:
            short = fig.split("_")[0] if fig != "metadata_bytes_per_block" else "bytes"
            line[short] = row[fig]
            line[f"{short}_vllm"] = row.get(f"baseline_{fig}")
            spread = row.get(f"speedup_{fig}_range")
            speedup = row.get(f"speedup_{fig}")
            line[f"{short}_x"] = (
                None
                if speedup is None
                else f"{speedup:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
            )
        table.append(line)
    columns = ["policy", "keys_per_call"]
    for short in ("store", "lookup", "load", "bytes"):
        columns += [short, f"{short}_vllm", f"{short}_x"]
    print_table(table, columns, out)
    print(
        f"goal: {GOAL_SPEEDUP:g}x vLLM on every time, at most {GOAL_BYTES_PER_BLOCK} bytes a block; "
        + ("met" if not below else "not met: " + ", ".join(below)),
        file=out,
    )
    return record


def lookup_floor(
    *, num_keys: int = 100_000, capacity: int = 50_000, runs: int = 15, out: TextIO | None = None
) -> dict[str, Any]:
    """Where a lookup's time goes (``kvtier bench manager --lookup-floor``): the protocol's
    lookup phase (every key once, half hit) on the state its store phase leaves (64 keys a
    call), timed for kvtier's manager with miss causes on (the default: the lookup and the
    batch that decides the misses' causes) and off, for vLLM's, and for the floors beside
    them on kvtier's own index dict: the probe alone in a loop, and the probe as a Python
    function of ``(key, context)`` (the least any dict-based ``lookup`` costs in CPython);
    and the sketch's hash of the missed keys (:func:`~kvtier.manager.causes.key_hashes`), per
    lookup. Rounds alternate the order of the subjects, and each subject starts with cold
    caches; each figure's min, median and max over ``runs`` rounds, and vLLM's time over it,
    the median of the rounds' own ratios.
    """
    out = out or sys.stdout
    keys = make_keys(num_keys)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir="/dev/shm") as shm_dir:
        subjects = [kvtier_subject(shm_dir), kvtier_subject(shm_dir, miss_causes="off")]
        baseline = vllm_subject()
        subjects += [baseline] if baseline is not None else []
        for policy in ("lru", "arc"):
            taken = _floor_rounds(subjects, policy, keys, capacity, runs)
            for name, times in taken.items():
                row: dict[str, Any] = {
                    "policy": policy,
                    "subject": name,
                    "ns_min": min(times),
                    "ns_median": median(times),
                    "ns_max": max(times),
                }
                if baseline is not None:
                    ratios = [theirs / mine for mine, theirs in zip(times, taken["vllm"])]
                    row["vllm_over"] = median(ratios)
                    row["vllm_over_range"] = _spread(ratios)
                rows.append(row)
    record: dict[str, Any] = {
        "bench": "manager_lookup_floor",
        "baseline": "vllm" if baseline is not None else None,
        "timer": "process_time",
        "num_keys": num_keys,
        "capacity_blocks": capacity,
        "runs": runs,
        "rows": rows,
    }
    print(
        f"kvtier bench manager --lookup-floor: {num_keys} lookups (half hit) over {capacity} blocks, "
        f"ns per lookup, CPU time, {runs} alternating rounds"
        + ("" if baseline else "; vLLM not importable: no baseline"),
        file=out,
    )
    table = [
        {
            "policy": row["policy"],
            "subject": row["subject"],
            "min": row["ns_min"],
            "median": row["ns_median"],
            "max": row["ns_max"],
            "vllm_over": None
            if "vllm_over" not in row
            else f"{row['vllm_over']:.2f} ({row['vllm_over_range'][0]:.2f}-{row['vllm_over_range'][1]:.2f})",
        }
        for row in rows
    ]
    print_table(table, ["policy", "subject", "min", "median", "max", "vllm_over"], out)
    return record


def _floor_rounds(
    subjects: list[Subject], policy: str, keys: list[bytes], capacity: int, runs: int
) -> dict[str, list[float]]:
    """:func:`lookup_floor`'s rounds for one policy: ns per lookup, each round's, by subject."""
    from kvtier.manager.causes import key_hashes

    managers, contexts = {}, {}
    for subject in subjects:
        manager = managers[subject.name] = subject.make_manager(policy, capacity)
        requests = enumerate(_chunks(keys, 64))
        _store(subject, manager, ((chunk, subject.make_context(f"r-{i}")) for i, chunk in requests))
        contexts[subject.name] = subject.make_context("lookups")
    index = managers["kvtier"].policy.contains.__self__  # the policy's dict (its bound __contains__)
    missed = [key for key in keys if key not in index]

    def probe_loop() -> None:
        for key in keys:
            key in index  # noqa: B015 (the probe is what is timed)

    def probe_function(key: bytes, req_context: Any) -> bool:
        return key in index

    def hashes() -> None:
        key_hashes(missed)  # type: ignore[arg-type]  # the bench's keys are plain bytes

    def calling(
        lookup: Callable[[bytes, Any], Any], ctx: Any, settle: Callable[[], None]
    ) -> Callable[[], None]:
        def timed() -> None:
            for key in keys:
                lookup(key, ctx)
            settle()

        return timed

    timed: dict[str, Callable[[], None]] = {
        "dict probe, inline": probe_loop,
        "dict probe in a function": calling(probe_function, None, lambda: None),
        "hash of each missed key": hashes,
    }
    for subject in subjects:
        manager = managers[subject.name]
        timed[subject.name] = calling(
            manager.lookup, contexts[subject.name], partial(subject.settle, manager)
        )
    names = list(timed)
    taken: dict[str, list[float]] = {name: [] for name in names}
    clock = time.process_time
    # written through before each subject: every one starts with the CPU's caches holding
    # none of its tables (else a subject timed after another on the same dict finds it warm)
    sweep = bytearray(_SWEEP_BYTES)
    lines = b"\1" * len(sweep[::64])
    try:
        for round_index in range(runs):
            for name in names if round_index % 2 == 0 else names[::-1]:
                sweep[::64] = lines
                start = clock()
                timed[name]()
                taken[name].append((clock() - start) / len(keys) * 1e9)
    finally:
        for manager in managers.values():
            manager.shutdown()
    return taken

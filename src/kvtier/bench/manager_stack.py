"""``kvtier bench manager --stack``: a step of the stack manager, at growing CPU-tier sizes.

The manager runs inside the engine's scheduler every step, so its cost per step must follow
what the step does, not how many blocks the tiers hold. This benchmark holds the step fixed
and grows the CPU tier (10^4, 10^5, 10^6 blocks by default).

Protocol (the same for kvtier and the baseline, at each size):

* a CPU tier of ``N`` blocks above one in-memory lower tier of ``N`` blocks, both filled until
  full, then run to their steady state (write_back: the manager keeps a quarter of the CPU
  tier clean by saving the coldest blocks below; every store evicts from the CPU tier, and
  every block saved evicts one from the lower tier);
* one step = one request that stores 64 new blocks (``prepare_store`` + ``complete_store``),
  looks up 64 blocks stored a few steps earlier (all CPU hits), loads 16 of them
  (``prepare_load``, ``complete_load``, ``touch``), finishes, and ends the step;
* ``us_per_step``: CPU time of the benchmark's process per step, the median over ``--runs`` rounds of ``--steps`` timed steps each (every
  manager is filled first, and each round times all of them in turn);
  ``us_per_block`` divides it by the 144 keys a step names; ``growth`` is
  ``us_per_step[largest] / us_per_step[smallest]``.

kvtier's side is :class:`~kvtier.manager.stack.TierStackManager` over a
:class:`~kvtier.testing.memory.MemoryBackend` CPU tier and a
:class:`~kvtier.testing.memory.MemoryTier` lower tier. Their rows are ``BLOCK_BYTES`` (64) bytes,
so 10^6 rows are 64 MB, not the gigabytes real blocks would take: this measures bookkeeping,
and the lower tier still copies and checksums every saved row.

The baseline is vLLM 0.33's ``TieringOffloadingManager`` built by its own
``TieringOffloadingSpec`` (CPU primary tier, LRU, write-through to vLLM's in-memory
``example`` secondary tier), driven the same way in the same run, when vLLM imports. Its CPU
region is a /dev/shm mapping of ``N`` 4 KiB rows that is never written, so its pages are not
materialised.

``bytes_per_block``: what tracemalloc sees the scheduler side allocate for the full CPU tier
of the middle size, at steady state, divided by its blocks — the manager, its policy, the
CPU tier's slot allocator; not the keys (the engine owns them), nor the rows, nor the lower
tier's own store and index (whatever is allocated under ``kvtier/tiers/indexed.py``'s frames,
where the lower tier keeps its own policy object).
"""

from __future__ import annotations

import gc
import hashlib
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any, TextIO

from kvtier.bench.report import print_table
from kvtier.errors import ConfigError

__all__ = ["run", "vllm_tiering_config"]

STORES, LOOKUPS, LOADS = 64, 64, 16
KEYS_PER_STEP = STORES + LOOKUPS + LOADS
#: payload bytes of one row on kvtier's side (the rows only have to exist and be copied)
BLOCK_BYTES = 64
#: how many steps back the looked-up blocks were stored (well inside the dirty, recent part)
LOOKBACK_STEPS = 4
DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
#: the smallest CPU tier the protocol runs on: the blocks of the last LOOKBACK_STEPS + 1 steps
#: must all stay while the rest of the tier turns over (twice that is enough)
MIN_SIZE = 2 * STORES * (LOOKBACK_STEPS + 1)
#: first key number of the blocks that fill the lower tier (never reached by the steps' keys)
_FILLER_KEYS = 1 << 40


def _keys(start: int, count: int) -> list[bytes]:
    """Keys ``start .. start+count``, 36 bytes like vLLM's (32-byte hash, 4-byte group)."""
    return [
        hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0" for i in range(start, start + count)
    ]


class _Driver:
    """One manager under the protocol: builds it, fills it, runs steps."""

    name = ""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.next_key = 0
        self.step_no = 0
        self.recent: list[list[bytes]] = []  # keys stored by each of the last steps

    def fill(self) -> None:
        """Store ``capacity`` blocks, then run steps until the tier is at its steady state."""
        batch = 4096
        while self.next_key < self.capacity:
            self._store_batch(_keys(self.next_key, min(batch, self.capacity - self.next_key)))
        for _ in range(3):  # the last saves finish: clean blocks to evict
            self._idle_step()
        for _ in range(LOOKBACK_STEPS + 8):
            self.step()

    def step(self, new_keys: list[bytes] | None = None) -> None:
        if new_keys is None:
            new_keys = _keys(self.next_key, STORES)
        self.next_key += STORES
        lookups = self.recent[0] if len(self.recent) >= LOOKBACK_STEPS else []
        self._step(new_keys, lookups, lookups[:LOADS])
        self.recent.append(new_keys)
        if len(self.recent) > LOOKBACK_STEPS:
            self.recent.pop(0)
        self.step_no += 1

    def _store_batch(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def check_steady(self) -> None:
        """Raise if the manager is not at the steady state the protocol measures."""
        raise NotImplementedError

    def _idle_step(self) -> None:
        raise NotImplementedError

    def _step(self, new_keys: list[bytes], lookups: list[bytes], loads: list[bytes]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ManagerDriver(_Driver):
    """A manager driven through the OffloadingManager calls: kvtier's and vLLM's run this one
    step, so the protocol cannot drift between them. A subclass sets ``manager`` and ``_hit``
    (what a lookup of a ready block answers) and makes its contexts and step ends."""

    manager: Any
    _hit: Any = True

    def _context(self, req_id: str) -> Any:
        raise NotImplementedError

    def _end_step(self, req_ids: tuple[str, ...]) -> None:
        """End the scheduler step in which the requests ``req_ids`` were new."""
        raise NotImplementedError

    def _store_batch(self, keys: list[bytes]) -> None:
        self._request(f"fill{self.next_key}", keys, [], [], "while filling")
        self.next_key += len(keys)

    def _idle_step(self) -> None:
        self._end_step(())

    def _step(self, new_keys: list[bytes], lookups: list[bytes], loads: list[bytes]) -> None:
        self._request(
            f"r{self.step_no}", new_keys, lookups, loads, f"at step {self.step_no} (not at steady state)"
        )

    def _request(
        self, req_id: str, new_keys: list[bytes], lookups: list[bytes], loads: list[bytes], when: str
    ) -> None:
        """One request in a step of its own: store ``new_keys``, look up ``lookups`` (every
        one must hit), load ``loads``, finish, end the step."""
        manager = self.manager
        ctx = self._context(req_id)
        manager.on_new_request(ctx)
        out = manager.prepare_store(new_keys, ctx)
        if out is None:
            raise RuntimeError(f"{self.name}: the CPU tier refused a store {when}")
        manager.complete_store(out.keys_to_store, ctx)
        lookup, hit = manager.lookup, self._hit
        for key in lookups:
            if lookup(key, ctx) is not hit:
                raise RuntimeError(f"{self.name}: a block stored {LOOKBACK_STEPS} steps ago missed")
        if loads:
            manager.prepare_load(loads, ctx)
            manager.complete_load(loads, ctx)
            manager.touch(loads, ctx)
        manager.on_request_finished(ctx)
        self._end_step((req_id,))

    def close(self) -> None:
        self.manager.shutdown()


class _KvtierDriver(_ManagerDriver):
    name = "kvtier"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        from kvtier.base import ReqContext
        from kvtier.config import CascadeConfig
        from kvtier.manager.stack import TierStackManager
        from kvtier.policies.lru import LRUPolicy
        from kvtier.testing import MemoryBackend, MemoryTier

        self._make_context = ReqContext
        backend = MemoryBackend(capacity, BLOCK_BYTES)
        # As many blocks below as in the CPU tier, and full from the start (blocks no step
        # names): every size then runs with the lower tier evicting its oldest for each block
        # saved. Left to fill through the manager, a tier of 10^4 would be full and evicting
        # while one of 10^6 was still filling, and the sizes would not run the same step.
        self.lower = MemoryTier("lower", backend.rows, capacity)
        self._fill_lower(capacity)
        self.manager = TierStackManager(
            backend,
            LRUPolicy(capacity),
            [self.lower],
            CascadeConfig(write_policy="write_back"),
            enable_events=False,
        )

    def _fill_lower(self, count: int) -> None:
        """Store ``count`` blocks of a key range no step uses straight into the lower tier
        (before the manager exists, so no job result of its own is taken here)."""
        from kvtier.base import OffloadKey
        from kvtier.tiers.base import TierJob

        batch = 4096
        for job_id, start in enumerate(range(0, count, batch), start=1):
            keys = _keys(_FILLER_KEYS + start, min(batch, count - start))
            self.lower.submit_store(TierJob(job_id, tuple(map(OffloadKey, keys)), tuple(range(len(keys)))))
            for result in self.lower.get_finished_jobs():
                if result.failed:
                    raise RuntimeError(f"kvtier: the lower tier refused filler blocks: {result.failed}")

    def _context(self, req_id: str) -> Any:
        return self._make_context(req_id)

    def _end_step(self, req_ids: tuple[str, ...]) -> None:
        self.manager.on_schedule_end()

    def check_steady(self) -> None:
        stats = self.manager.stats()
        if stats["ready_blocks"] != self.capacity or stats["evictions"] == 0 or stats["lower.evicted"] == 0:
            raise RuntimeError(f"kvtier: not at steady state: {stats}")


class _FloorDriver(_Driver):
    """The least any dict-based manager does under the protocol, as a reference: one
    ``OrderedDict`` of key -> row, LRU. A step evicts its 64 oldest keys and inserts the 64 new
    ones, probes the 64 looked-up keys and moves the 16 loaded ones to the recent end — no
    lower tier, no dirty blocks, no holds, no checks.

    Its growth is the price of the memory hierarchy alone: at 10^6 keys the evicted keys'
    entries, and the table slots new keys land in, are cache and TLB misses, whatever code
    touches them. A manager's growth above it comes from the work it adds, below it only
    from hiding that price behind more work.
    """

    name = "floor"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        from collections import OrderedDict

        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.evictions = 0

    def _store_batch(self, keys: list[bytes]) -> None:
        index = self.index
        for key in keys:
            index[key] = len(index)
        self.next_key += len(keys)

    def _idle_step(self) -> None:
        pass

    def _step(self, new_keys: list[bytes], lookups: list[bytes], loads: list[bytes]) -> None:
        index = self.index
        popitem = index.popitem
        rows = [popitem(last=False)[1] for _ in new_keys]
        self.evictions += len(rows)
        index.update(zip(new_keys, rows))
        for key in lookups:
            if key not in index:
                raise RuntimeError(f"floor: a block stored {LOOKBACK_STEPS} steps ago missed")
        move_to_end = index.move_to_end
        for key in loads:
            move_to_end(key)

    def check_steady(self) -> None:
        if len(self.index) != self.capacity:
            raise RuntimeError(f"floor: {len(self.index)} keys, not {self.capacity}")

    def close(self) -> None:
        self.index.clear()


def vllm_tiering_config(
    extra_config: dict[str, Any], *, tokens_per_block: int, block_bytes: int, name: str
) -> Any:
    """vLLM 0.33's ``OffloadingConfig`` for a one-layer, one-worker engine whose offloaded block
    is one GPU block of ``tokens_per_block`` tokens and ``block_bytes`` bytes: what a driver of
    vLLM's own offloading stack hands its spec (``name`` stands for the model and the engine).
    Imports vLLM."""
    import uuid

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block, layer_names=("model.layers.0.attn",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=f"{name}-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=f"{name}/none", dtype="float16", max_model_len=0),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


class _VllmDriver(_ManagerDriver):
    name = "vllm"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        import logging

        logging.getLogger("vllm").setLevel(logging.WARNING)
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self._hit = LookupResult.HIT
        self._make_context = ReqContext
        self._end = ScheduleEndContext
        row = TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT  # vLLM's smallest row: one page
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": capacity * row,
            "eviction_policy": "lru",
            "secondary_tiers": [{"type": "example"}],
        }
        config = vllm_tiering_config(extra, tokens_per_block=16, block_bytes=row, name="kvtier-bench")
        self.manager = TieringOffloadingSpec(config).get_manager()

    def _context(self, req_id: str) -> Any:
        return self._make_context(req_id=req_id)

    def _end_step(self, req_ids: tuple[str, ...]) -> None:
        self.manager.on_schedule_end(self._end(new_req_ids=req_ids, preempted_req_ids=()))

    def check_steady(self) -> None:
        pass  # every step's store would have been refused (and raised) without room


def _vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except Exception:  # any import failure means: no vLLM here
        return False
    return True


def _time_steps(driver: _Driver, steps: int) -> float:
    """CPU seconds per step over ``steps`` steps (keys made before the clock starts).

    CPU time of this process rather than wall time: on a shared machine, time spent waiting
    for a core is not the manager's.
    """
    batches = [_keys(driver.next_key + i * STORES, STORES) for i in range(steps)]
    gc.collect()
    gc.disable()  # a collection pass walks every tracked object: its cost would be the heap's
    try:
        start = time.process_time()
        for keys in batches:
            driver.step(keys)
        return (time.process_time() - start) / steps
    finally:
        gc.enable()


def _bytes_per_block(
    make: Callable[[int], _Driver], capacity: int, exclude: Sequence[str], exclude_below: Sequence[str] = ()
) -> float:
    """Scheduler-side bytes per CPU block at steady state (tracemalloc, filtered).

    ``exclude``: files whose own allocations are not counted; ``exclude_below``: files none
    of whose callees' allocations are counted either (the lower tier's index, made by a
    policy object that tier owns).
    """
    gc.collect()
    tracemalloc.start(32)  # deep enough to see the tier's frame under the policy's
    try:
        driver = make(capacity)
        driver.fill()
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    filters = [tracemalloc.Filter(False, pattern) for pattern in (__file__, *exclude)]
    filters += [tracemalloc.Filter(False, pattern, all_frames=True) for pattern in exclude_below]
    used = sum(stat.size for stat in snapshot.filter_traces(filters).statistics("filename"))
    driver.close()
    return used / capacity


def run(
    *, sizes: Sequence[int] = DEFAULT_SIZES, steps: int = 1000, runs: int = 5, out: TextIO | None = None
) -> dict[str, Any]:
    """Run the benchmark; print the table; return the JSON record (the CLI prints it with --json)."""
    out = out or sys.stdout
    sizes = sorted(sizes)
    if not sizes or sizes[0] < MIN_SIZE:
        raise ConfigError(
            "--sizes",
            ",".join(map(str, sizes)),
            f"CPU-tier sizes of at least {MIN_SIZE} blocks",
            f"a step looks up the blocks stored {LOOKBACK_STEPS} steps before, which a smaller "
            "tier has evicted: e.g. --sizes 10000,100000",
        )
    if steps < 1 or runs < 1:
        raise ConfigError("--steps/--runs", (steps, runs), "at least 1 each", "e.g. --steps 1000 --runs 5")
    subjects: list[Callable[[int], _Driver]] = [_KvtierDriver, _FloorDriver]
    if _vllm_available():
        subjects.append(_VllmDriver)
    # Every manager is built and filled first, then the rounds go round all of them: a noisy
    # neighbour on a shared machine then slows every size and subject alike, and the medians
    # compare like with like.
    drivers: list[_Driver] = []
    samples: dict[tuple[str, int], list[float]] = {}
    try:
        for make in subjects:
            for size in sizes:
                driver = make(size)
                drivers.append(driver)
                driver.fill()
                driver.check_steady()
        for _ in range(runs):
            for driver in drivers:
                samples.setdefault((driver.name, driver.capacity), []).append(_time_steps(driver, steps))
        for driver in drivers:
            driver.check_steady()
    finally:
        for driver in drivers:
            driver.close()
    del drivers
    gc.collect()
    us_per_step: dict[str, dict[str, float]] = {}
    for (name, size), values in samples.items():
        us_per_step.setdefault(name, {})[str(size)] = median(values) * 1e6
    middle = sizes[len(sizes) // 2]
    # The lower tier's store, the rows and the shared region are not scheduler metadata.
    memory = {
        "kvtier": _bytes_per_block(
            _KvtierDriver, middle, ["*/kvtier/testing/memory.py"], exclude_below=["*/kvtier/tiers/indexed.py"]
        ),
    }
    if _VllmDriver in subjects:
        memory["vllm"] = _bytes_per_block(_VllmDriver, middle, ["*/vllm/v1/kv_offload/tiering/example/*"])

    rows: list[dict[str, Any]] = []
    for size in sizes:
        row: dict[str, Any] = {"cpu_blocks": size}
        for name, figures in us_per_step.items():
            row[f"{name}_us_per_step"] = figures[str(size)]
            row[f"{name}_us_per_block"] = figures[str(size)] / KEYS_PER_STEP
        if "vllm" in us_per_step:
            row["speedup"] = row["vllm_us_per_step"] / row["kvtier_us_per_step"]
        rows.append(row)
    first, last = str(sizes[0]), str(sizes[-1])
    record: dict[str, Any] = {
        "bench": "manager_stack",
        "baseline": "vllm" if "vllm" in us_per_step else None,
        "protocol": {
            "stores": STORES,
            "lookups": LOOKUPS,
            "loads": LOADS,
            "write_policy": "write_back",
            "policy": "lru",
            "block_bytes": BLOCK_BYTES,
        },
        "steps": steps,
        "runs": runs,
        "us_per_step": us_per_step["kvtier"],
        "us_per_block": {size: value / KEYS_PER_STEP for size, value in us_per_step["kvtier"].items()},
        "growth": us_per_step["kvtier"][last] / us_per_step["kvtier"][first],
        "bytes_per_block": memory["kvtier"],
        "bytes_per_block_at": middle,
    }
    floor = us_per_step["floor"]
    record["floor_us_per_step"] = floor
    record["floor_growth"] = floor[last] / floor[first]
    if "vllm" in us_per_step:
        vllm = us_per_step["vllm"]
        record["vllm_us_per_step"] = vllm
        record["vllm_growth"] = vllm[last] / vllm[first]
        record["vllm_bytes_per_block"] = memory["vllm"]
        record["speedup"] = {size: vllm[size] / us_per_step["kvtier"][size] for size in vllm}
    print(
        f"kvtier bench manager --stack: {STORES} stores, {LOOKUPS} lookups, {LOADS} loads and a step "
        f"end per step, CPU tier full, write_back; median of {runs} rounds of {steps} steps; "
        f"baseline = {'vLLM TieringOffloadingManager measured now' if record['baseline'] else 'none (vllm not importable)'}",
        file=out,
    )
    columns = ["cpu_blocks", "kvtier_us_per_step", "kvtier_us_per_block", "floor_us_per_step"]
    if "vllm" in us_per_step:
        columns += ["vllm_us_per_step", "vllm_us_per_block", "speedup"]
    print_table(rows, columns, out)
    summary = (
        f"growth {sizes[-1]}/{sizes[0]}: kvtier {record['growth']:.2f}, floor {record['floor_growth']:.2f}"
    )
    if "vllm" in us_per_step:
        summary += f", vLLM {record['vllm_growth']:.2f}"
    summary += f"; bytes per tracked block at {middle}: kvtier {memory['kvtier']:.0f}"
    if "vllm" in memory:
        summary += f", vLLM {memory['vllm']:.0f}"
    print(summary, file=out)
    return record

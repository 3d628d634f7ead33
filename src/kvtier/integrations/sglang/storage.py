"""``KvtierHiCacheStorage``: kvtier's lower tiers as SGLang HiCache's L3 storage backend.

SGLang 0.5.23 builds it from settings alone::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "config": "/etc/kvtier/sglang.yaml"}'

Its ``StorageBackendFactory`` calls ``KvtierHiCacheStorage(storage_config, kwargs)`` on every
rank, then the cache controller registers the rank's host pool. The tiers open then (their
rows are the host pool's pages, see :mod:`~kvtier.integrations.sglang.pages`), each by its
kind's ``open_lower`` exactly as under vLLM: capacity, eviction, verified blocks, the layout
fingerprint, admission and the shared Valkey tier behave the same.

Who calls it: SGLang's storage threads (the prefetch thread asks ``batch_exists``, the
prefetch I/O thread ``batch_get_v1``, the backup thread ``batch_set_v1``), concurrently. The
tiers' own API is single-threaded (one scheduler thread, non-blocking), so every tier call
is made under :attr:`_lock`; a call then waits, outside the lock, for its job's result —
blocking is what SGLang expects of these methods.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.base import OffloadKey
from kvtier.build import admission_filters
from kvtier.errors import KvtierError
from kvtier.integrations.sglang.pages import PageRows
from kvtier.integrations.sglang.settings import (
    PoolFacts,
    ShardFacts,
    layout_fingerprint,
    page_key,
    resolve_settings,
)
from kvtier.policies.admission import AdmissionFilter
from kvtier.tiers.base import FailureKind, SecondaryTier, TierJob, TierJobResult

__all__ = ["KvtierHiCacheStorage"]

logger = logging.getLogger("sglang.kvtier")

# a job's result is polled this often while the caller waits (kvtier's tiers report results
# by polling; waking sooner buys nothing at the disk's ~100 us per block)
_POLL_S = 0.0005
_POLL_MAX_S = 0.005
# a wait that goes on this long is logged (once per wait), never abandoned: the tier still
# owns the job's rows, which are SGLang's host pages
_SLOW_WAIT_S = 30.0


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over kvtier's lower tiers (lmdb, files, valkey, any registered kind).

    Built by SGLang's ``StorageBackendFactory`` (``dynamic`` backend). Construction parses the
    extra config (a :class:`~kvtier.errors.ConfigError` names what is wrong and the fix);
    :meth:`register_mem_pool_host` opens the tiers over the host pool (blocks for the
    directory checks and the index scan). Every other method may block for its I/O.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        #: the parsed settings: the kvtier stack (tiers[0] stands for the host pool)
        self.settings = resolve_settings(storage_config.extra_config)
        #: this rank's place: which shard of each page it stores and reads
        self.shard = ShardFacts.from_storage_config(storage_config)
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)
        self._results: dict[int, TierJobResult] = {}
        self._tiers: list[SecondaryTier] = []
        self._admission: list[AdmissionFilter] = []
        self._pages: PageRows | None = None
        self._counters: dict[str, int] = {}
        self._final: dict[str, float] = {}
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._warned: set[str] = set()
        if not self.settings.interface_v1:
            logger.warning(
                "kvtier: interface_v1 is not set in --hicache-storage-backend-extra-config: "
                "SGLang will pass copies of pages (get/set) instead of host slots, each page "
                'copied twice more through a borrowed host page; add "interface_v1": 1'
            )

    # -- opening -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tiers over ``mem_pool_host`` (SGLang's cache controller calls this once)."""
        if self._pages is not None:
            if mem_pool_host is self._pages.pool:
                return
            raise KvtierError("kvtier: a second host pool registered; one backend serves one pool")
        super().register_mem_pool_host(mem_pool_host)
        pages = PageRows(mem_pool_host, self.settings.staging_pages)
        pool = PoolFacts.from_host_pool(mem_pool_host)
        fingerprint = layout_fingerprint(
            pool, self.shard, block_bytes=pages.block_bytes, parts=pages.parts, staged=pages.staged
        )
        tiers: list[SecondaryTier] = []
        try:
            for index, tier in enumerate(self.settings.lower_tiers, start=1):
                tiers.append(tier.open_lower(pages.rows, fingerprint, field=self.settings.tier_field(index)))
        except BaseException:
            for opened in tiers:
                opened.close()
            raise
        try:
            # one decision per page: a budget charges, and a sketch sizes by, a whole page
            self._admission = admission_filters(
                self.settings.lower_tiers, pages.block_bytes * pages.parts, field=self.settings.tier_field
            )
        except BaseException:  # a budget contradicting the drive's size is found only now
            for opened in tiers:
                opened.close()
            raise
        self._pages, self._tiers = pages, tiers
        logger.info(
            "kvtier: %s pages of %d tokens as %d block(s) of %d bytes (%s), shard %d%s, tiers %s; layout %s",
            pool.layout,
            pool.page_size,
            pages.parts,
            pages.block_bytes,
            "staged" if pages.staged else "in place",
            self.shard.shard,
            " (replicated: MLA)" if self.shard.replicated else "",
            ", ".join(f"{t.name} ({t.medium})" for t in tiers),
            fingerprint.describe(),
        )

    @property
    def tiers(self) -> list[SecondaryTier]:
        """The open tiers, fastest first (for ``check()`` and tests)."""
        return list(self._tiers)

    def _rows(self) -> PageRows:
        if self._pages is None:
            raise KvtierError(
                "kvtier: no host pool registered yet; SGLang calls register_mem_pool_host first"
            )
        return self._pages

    # -- counting --------------------------------------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._lock:
                self._counters[name] = self._counters.get(name, 0) + amount

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    # -- tier jobs -------------------------------------------------------------------------------

    def _run(
        self, tier: SecondaryTier, is_load: bool, keys: list[OffloadKey], rows: list[int]
    ) -> TierJobResult:
        """Submit one job and wait for its result (other threads' results are kept for them)."""
        with self._lock:
            job_id = next(self._job_ids)
            job = TierJob(job_id, tuple(keys), tuple(rows))
            if is_load:
                tier.submit_load(job)
            else:
                tier.submit_store(job)
        started = time.monotonic()
        pause, logged = _POLL_S, False
        while True:
            with self._lock:
                for result in tier.get_finished_jobs():
                    self._results[result.job_id] = result
                tier.take_events()  # nobody publishes events from here: do not let them pile up
                found = self._results.pop(job_id, None)
            if found is not None:
                return found
            if not logged and time.monotonic() - started > _SLOW_WAIT_S:
                logged = True
                logger.warning(
                    "kvtier: tier %s job %d still running after %.0f s", tier.name, job_id, _SLOW_WAIT_S
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _lookup(self, tier: SecondaryTier, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether ``tier`` holds each key, settling keys it does not know yet (a remote tier
        asks its server at ``on_schedule_end``; it answers within its own timeout)."""
        with self._lock:
            answers = [tier.lookup(key) for key in keys]
        pause = _POLL_S
        while None in answers:
            with self._lock:
                tier.on_schedule_end()
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
            with self._lock:
                answers = [
                    tier.lookup(key) if answer is None else answer for key, answer in zip(keys, answers)
                ]
        return [bool(answer) for answer in answers]

    def _page_keys(self, key: str) -> list[OffloadKey]:
        return [page_key(key, self.shard.shard, part) for part in range(self._rows().parts)]

    def _page_starts(self, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        page_size = self._rows().page_size
        if host_indices is None or int(host_indices.numel()) != len(keys) * page_size:
            self._warn_once(
                "indices",
                "kvtier: %d keys with %s host slots (pages of %d tokens): call refused",
                len(keys),
                None if host_indices is None else int(host_indices.numel()),
                page_size,
            )
            return None
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    # -- pages in and out ------------------------------------------------------------------------

    def _store(self, keys: Sequence[str], starts: Sequence[int]) -> list[bool]:
        pages = self._rows()
        if not pages.staged:
            rows = [pages.page_rows(start) for start in starts]
            return self._store_rows(keys, rows)
        results: list[bool] = []
        for begin in range(0, len(keys), pages.staging_pages):
            chunk = list(range(begin, min(len(keys), begin + pages.staging_pages)))
            taken = pages.acquire(len(chunk))
            try:
                for index, row in zip(chunk, taken):
                    pages.stage_out(starts[index], row)
                results += self._store_rows([keys[i] for i in chunk], [[row] for row in taken])
            finally:
                pages.release(taken)
        return results

    def _store_rows(self, keys: Sequence[str], rows: Sequence[list[int]]) -> list[bool]:
        """Store each page (its parts in ``rows``) in every tier that admits it; a page is
        stored when one tier holds all of its parts."""
        started = time.perf_counter()
        stored = [False] * len(keys)
        refused = [False] * len(keys)
        page_keys = [self._page_keys(key) for key in keys]
        for tier, admission in zip(self._tiers, self._admission):
            if admission.budget is not None:
                with self._lock:
                    admission.budget.tick()
            job_keys: list[OffloadKey] = []
            job_rows: list[int] = []
            wanted: list[int] = []
            seen: dict[OffloadKey, int] = {}
            repeats: list[tuple[int, int]] = []
            with self._lock:
                for index, parts in enumerate(page_keys):
                    if parts[0] in seen:
                        # the same page twice in one call: one job takes a key once
                        repeats.append((index, seen[parts[0]]))
                        continue
                    seen[parts[0]] = index
                    admission.record(parts[0])
                    if not admission.admit(parts[0]):
                        refused[index] = True
                        continue
                    wanted.append(index)
                    job_keys += parts
                    job_rows += rows[index]
            if not job_keys:
                continue
            result = self._run(tier, False, job_keys, job_rows)
            if admission.budget is not None:
                with self._lock:
                    admission.budget.wrote(result.nbytes)
            ok = set(result.ok)
            for index in wanted:
                if all(key in ok for key in page_keys[index]):
                    stored[index] = True
            for index, first in repeats:
                stored[index] = stored[index] or stored[first]
            self._count(
                f"{tier.name}.pages_stored", sum(1 for i in wanted if all(k in ok for k in page_keys[i]))
            )
        done = sum(stored)
        self._count("pages_stored", done)
        self._count("pages_store_failed", sum(1 for s, r in zip(stored, refused) if not s and not r))
        self._count("pages_refused", sum(1 for s, r in zip(stored, refused) if not s and r))
        self._record("backup", done, time.perf_counter() - started)
        return stored

    def _load(self, keys: Sequence[str], starts: Sequence[int]) -> list[bool]:
        pages = self._rows()
        if not pages.staged:
            rows = [pages.page_rows(start) for start in starts]
            return self._load_rows(keys, rows)
        results: list[bool] = []
        for begin in range(0, len(keys), pages.staging_pages):
            chunk = list(range(begin, min(len(keys), begin + pages.staging_pages)))
            taken = pages.acquire(len(chunk))
            try:
                loaded = self._load_rows([keys[i] for i in chunk], [[row] for row in taken])
                for index, row, ok in zip(chunk, taken, loaded):
                    if ok:
                        pages.stage_in(starts[index], row)
                results += loaded
            finally:
                pages.release(taken)
        return results

    def _load_rows(self, keys: Sequence[str], rows: Sequence[list[int]]) -> list[bool]:
        """Read each page from the first tier that serves every part of it, verified."""
        started = time.perf_counter()
        loaded = [False] * len(keys)
        page_keys = [self._page_keys(key) for key in keys]
        corrupt = 0
        for tier in self._tiers:
            remaining = [i for i in range(len(keys)) if not loaded[i]]
            if not remaining:
                break
            if not self._defers:
                # pages this tier does not hold are not asked of it (a disk read each)
                held = self._lookup(tier, [page_keys[i][0] for i in remaining])
                remaining = [i for i, present in zip(remaining, held) if present]
            job_keys: list[OffloadKey] = []
            job_rows: list[int] = []
            for index in remaining:
                job_keys += page_keys[index]
                job_rows += rows[index]
            if not job_keys:
                continue
            result = self._run(tier, True, job_keys, job_rows)
            ok = set(result.ok)
            corrupt += sum(1 for reason in result.failed.values() if reason.kind is FailureKind.CORRUPT)
            served = [i for i in remaining if all(key in ok for key in page_keys[i])]
            for index in served:
                loaded[index] = True
            if served:
                with self._lock:
                    tier.touch([key for i in served for key in page_keys[i]])
            self._count(f"{tier.name}.pages_loaded", len(served))
        done = sum(loaded)
        self._count("pages_loaded", done)
        self._count("pages_load_failed", len(keys) - done)
        self._count("blocks_corrupt", corrupt)
        self._record("prefetch", done, time.perf_counter() - started)
        return loaded

    @property
    def _defers(self) -> bool:
        """A replicated (MLA) rank that does not write: the writing rank stored its pages in
        the shared store after this process opened it, so this process's view lacks them.
        It answers "present" and reads them (loads resolve on the medium, and verify), and
        SGLang's minimum over ranks takes the writer's answer."""
        return self.shard.replicated and not self.shard.writer

    def _exists(self, keys: Sequence[str]) -> int:
        """How many pages from the first are held, every part in one tier."""
        if not keys or not self._tiers:
            return 0
        if self._defers:
            return len(keys)
        first = [self._page_keys(key) for key in keys]
        present = [False] * len(keys)
        for tier, admission in zip(self._tiers, self._admission):
            remaining = [i for i in range(len(keys)) if not present[i]]
            if not remaining:
                break
            with self._lock:
                for i in remaining:
                    admission.record(first[i][0])
            flat = [key for i in remaining for key in first[i]]
            answers = iter(self._lookup(tier, flat))
            for index in remaining:
                parts = [next(answers) for _ in first[index]]
                present[index] = all(parts)
        hits = present.index(False) if False in present else len(present)
        self._count("exists_hit_pages", hits)
        self._count("exists_miss_pages", len(keys) - hits)
        return hits

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        nbytes = pages * self._rows().block_bytes * self._rows().parts
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # -- SGLang's page interface (v1: host slots, no copy) ----------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._exists(keys)

    def exists(self, key: str) -> bool:
        return self._exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        starts = self._page_starts(keys, host_indices)
        return [False] * len(keys) if starts is None else self._load(keys, starts)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        starts = self._page_starts(keys, host_indices)
        return [False] * len(keys) if starts is None else self._store(keys, starts)

    # -- v2: per pool (kvtier stores the KV pool; other pools are misses) ------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        kv_pages = self._exists(keys)
        hit_count: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if transfer.name != PoolName.KV:
                # a pool kvtier does not store (Mamba, SWA, indexer ...) holds no page: no
                # prefix can be restored with it
                self._warn_once(str(transfer.name), "kvtier stores the KV pool only, not %s", transfer.name)
                restorable = []
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _batch_v2(self, transfers: list[PoolTransfer], is_load: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if transfer.name != PoolName.KV:
                self._warn_once(str(transfer.name), "kvtier stores the KV pool only, not %s", transfer.name)
                self._count("unsupported_pool_pages", len(keys))
                results[transfer.name] = [False] * len(keys)
            elif is_load:
                results[transfer.name] = self.batch_get_v1(keys, transfer.host_indices)
            else:
                results[transfer.name] = self.batch_set_v1(keys, transfer.host_indices)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, is_load=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, is_load=False)

    # -- the tensor forms (SGLang without interface_v1): through a borrowed host page ----------

    def _borrow(self) -> int | None:
        pool = self._rows().pool
        slots = pool.alloc(self._rows().page_size)
        if slots is None:
            self._count("generic_no_host_page")
            return None
        return int(slots[0])

    def _give_back(self, start: int) -> None:
        import torch

        pool = self._rows().pool
        pool.free(torch.arange(start, start + self._rows().page_size, dtype=torch.int64))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read page ``key`` into ``target_location`` (a flat page tensor); it, or None."""
        if target_location is None:
            raise TypeError("kvtier: get() needs target_location, a flat page tensor to read into")
        start = self._borrow()
        if start is None:
            return None
        try:
            if not self._load([key], [start])[0]:
                return None
            page = self._rows().pool.get_data_page(start, flat=True)
            target_location.view(-1).copy_(page.view(target_location.dtype).view(-1))
            return target_location
        finally:
            self._give_back(start)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (a flat page tensor, SGLang's get_data_page form) as page ``key``."""
        if value is None:
            raise TypeError("kvtier: set() needs value, a flat page tensor")
        start = self._borrow()
        if start is None:
            return False
        try:
            pool = self._rows().pool
            pool.set_from_flat_data_page(start, value)
            return self._store([key], [start])[0]
        finally:
            self._give_back(start)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            raise TypeError("kvtier: batch_set() needs values, flat page tensors")
        return all([self.set(key, value) for key, value in zip(keys, values)])

    # -- stats and lifecycle ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """kvtier's counters: the backend's (``pages_stored``, ``pages_loaded``,
        ``pages_load_failed``, ``blocks_corrupt``, ``pages_refused``, ``exists_hit_pages`` ...)
        and each tier's as ``<tier>.<counter>``; after :meth:`close`, the last figures."""
        if not self._tiers:
            return dict(self._final)
        with self._lock:
            figures: dict[str, float] = dict(self._counters)
            for tier, admission in zip(self._tiers, self._admission):
                figures.update((f"{tier.name}.{k}", v) for k, v in tier.stats().items())
                figures[f"{tier.name}.admitted"] = admission.admitted
                figures[f"{tier.name}.refused"] = admission.refused
                if admission.budget is not None:
                    figures.update((f"{tier.name}.{k}", v) for k, v in admission.budget.stats().items())
        return figures

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics for the calls since the last one (with
        ``--enable-cache-report``/storage metrics on), else None."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            taken = {name: values[:] for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return StorageMetrics(
            prefetch_pgs=[int(v) for v in taken["prefetch_pgs"]],
            backup_pgs=[int(v) for v in taken["backup_pgs"]],
            prefetch_bandwidth=taken["prefetch_bandwidth"],
            backup_bandwidth=taken["backup_bandwidth"],
        )

    def clear(self) -> None:
        """SGLang's ``/clear_hicache_storage_backend``: kvtier's tiers are not emptied by it.

        A kvtier store is shared (by the engine's ranks, by other engines on the host or on a
        Valkey server) and the tier contract has no bulk removal; a store is emptied by
        removing its directory (lmdb, files) or its namespace with ``kvtier check --fix``
        while no engine uses it. Logged, so the request is not silently taken for done.
        """
        logger.warning(
            "kvtier: clear requested; kvtier's tiers keep their blocks (remove the store "
            "directory, or the Valkey namespace, while no engine uses it: see docs/sglang.md)"
        )

    def close(self) -> None:
        """Wait for jobs in flight and close every tier. Idempotent."""
        tiers, self._tiers = self._tiers, []
        if not tiers:
            return
        final = self._stats_of(tiers)
        try:
            for tier in tiers:
                tier.close()
        finally:
            self._final = final

    def _stats_of(self, tiers: Iterable[SecondaryTier]) -> dict[str, float]:
        with self._lock:
            figures: dict[str, float] = dict(self._counters)
            for tier in tiers:
                figures.update((f"{tier.name}.{k}", v) for k, v in tier.stats().items())
        return figures

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; the tiers' own finalizers run
            pass

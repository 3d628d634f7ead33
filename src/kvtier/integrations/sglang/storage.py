"""``KvtierHiCacheStorage``: kvtier's lower tiers as SGLang HiCache's L3 storage backend.

SGLang 0.5.23 builds it from settings alone::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "config": "/etc/kvtier/sglang.yaml"}'

Its ``StorageBackendFactory`` calls ``KvtierHiCacheStorage(storage_config, kwargs)`` on every
rank, then the cache controller registers the rank's host pool, and at start perhaps the
draft model's (``register_mem_host_pool_v2``), whose pages get stores of their own beside the
KV pool's, sharing each tier's capacity
(:func:`~kvtier.integrations.sglang.settings.pool_tiers`); a pool kvtier does not store is
refused there, which fails SGLang's attach with the reason. The tiers open once the pools are
known — when the draft pool registers, or at the first page operation — over the host pools'
pages (see :mod:`~kvtier.integrations.sglang.pages`), each by its kind's ``open_lower`` exactly
as under vLLM: capacity, eviction, verified blocks, the layout fingerprint, admission and the
shared Valkey tier behave the same.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
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
    check_pool_name,
    layout_fingerprint,
    page_key,
    pool_tiers,
    resolve_settings,
)
from kvtier.policies.admission import AdmissionFilter
from kvtier.config import TierConfig
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


@dataclass
class _PoolStore:
    """One SGLang host pool's pages in kvtier: where they lie, and the tiers holding them."""

    #: SGLang's pool name (``kv``, ``draft``)
    name: str
    pages: PageRows
    #: this rank's shard of the pool's pages
    shard: ShardFacts
    #: what the pool's pages are (for the layout fingerprint)
    facts: PoolFacts
    #: the open tiers, fastest first, and each one's admission (empty until the stores open)
    tiers: list[SecondaryTier] = field(default_factory=list)
    admission: list[AdmissionFilter] = field(default_factory=list)

    def stat(self, counter: str) -> str:
        """The backend counter ``counter`` of this pool (the KV pool's have no prefix)."""
        return counter if self.name == PoolName.KV else f"{self.name}_{counter}"


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over kvtier's lower tiers (lmdb, files, valkey, any registered kind).

    Built by SGLang's ``StorageBackendFactory`` (``dynamic`` backend). Construction parses the
    extra config (a :class:`~kvtier.errors.ConfigError` names what is wrong and the fix);
    :meth:`register_mem_pool_host` takes the host pool, :meth:`register_mem_host_pool_v2` an
    extra pool and opens the tiers (blocking for the directory checks and the index scan), and
    without an extra pool the first page operation opens them. Every method may block for its
    I/O.
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
        #: the pools' stores by SGLang's pool name, the KV pool's first (added under _lock)
        self._stores: dict[str, _PoolStore] = {}
        #: whether the pools' tiers are open (:meth:`_open_stores`, once, under _open_lock)
        self._opened = False
        self._open_lock = threading.Lock()
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
                "SGLang will pass copies of pages (batch_get/batch_set) instead of host slots, "
                'each copied twice more (by SGLang, and through kvtier\'s staging buffer); add "interface_v1": 1'
            )

    # -- opening -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take ``mem_pool_host``, the KV pool (SGLang's cache controller calls this once); its
        tiers open later (:meth:`_open_stores`). Without ``interface_v1`` SGLang hands over
        copies of pages, never host slots, so the tiers then open over a staging buffer
        instead of the pool."""
        kv = self._stores.get(PoolName.KV)
        if kv is not None:
            if mem_pool_host is kv.pages.pool:
                return
            raise KvtierError("kvtier: a second host pool registered; one backend serves one pool")
        super().register_mem_pool_host(mem_pool_host)
        self._add(PoolName.KV, mem_pool_host, self.settings.interface_v1)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take SGLang's pool ``host_pool_name`` (the KV pool again, or the draft model's, which
        SGLang registers after attaching the backend, before serving) and open every pool's
        tiers; :class:`ConfigError` for a pool kvtier does not store (Mamba, SWA, indexers),
        which fails SGLang's attach."""
        name = str(host_pool_name)
        check_pool_name(name)
        known = self._stores.get(name)
        if known is not None and known.pages.pool is host_pool:
            return
        if name == PoolName.KV and known is None:
            self.register_mem_pool_host(host_pool)
            return
        if known is not None or PoolName.KV not in self._stores:
            raise KvtierError(
                f"kvtier: host pool {name!r} registered "
                + ("twice, as another pool" if known is not None else "before the KV pool")
            )
        with self._open_lock:  # a page operation opening the stores now would leave it out
            if self._opened:
                raise KvtierError(
                    f"kvtier: host pool {name!r} registered after the first page operation, when "
                    "the KV pool's stores had opened with the whole capacity; SGLang registers it at start"
                )
            self._add(name, host_pool, True)  # SGLang hands an extra pool's transfers over with host slots
        try:
            self._open_stores()  # the draft is the one extra pool kvtier stores: the pools are known
        except BaseException:
            with self._lock:
                del self._stores[name]
            raise
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _add(self, name: str, pool: Any, in_place: bool) -> None:
        """Keep pool ``name``'s pages, to open its tiers over (:class:`ConfigError` for a pool
        kvtier cannot read)."""
        name = str(name)
        facts = PoolFacts.from_host_pool(pool, name)
        pages = PageRows(pool, self.settings.staging_pages, in_place=in_place)
        store = _PoolStore(name, pages, self.shard.for_pool(facts), facts)
        with self._lock:  # the draft pool registers while SGLang's storage threads run
            self._stores[name] = store

    def _open_stores(self) -> None:
        """Open every registered pool's tiers, once, sharing each tier's capacity
        (:func:`~kvtier.integrations.sglang.settings.pool_tiers`). Not when the KV pool
        registers: the draft pool comes later, and a KV store opened with the whole capacity
        and narrowed then would already have taken the room (an lmdb slab) its draft store
        needs. So they open when the draft pool registers, or, without one, at the first page
        operation (docs/sglang.md, "Capacity with a draft pool")."""
        with self._open_lock:
            if self._opened or PoolName.KV not in self._stores:
                return
            forms = {name: (s.pages.block_bytes, s.pages.parts) for name, s in self._stores.items()}
            configs = pool_tiers(self.settings, forms)
            opened: list[_PoolStore] = []
            try:
                for store in self._stores.values():
                    # an extra pool's tiers write on the KV pool's drives: they charge its budgets
                    self._open(store, configs[store.name], opened[0].admission if opened else ())
                    opened.append(store)
            except BaseException:
                for store in opened:
                    for tier in store.tiers:
                        tier.close()
                    store.tiers, store.admission = [], []
                raise
            self._opened = True

    def _open(
        self, store: _PoolStore, configs: Sequence[TierConfig], shared_budgets: Sequence[AdmissionFilter]
    ) -> None:
        """Open ``store``'s tiers (``configs``) over its pages."""
        name, pages, shard, facts = store.name, store.pages, store.shard, store.facts
        fingerprint = layout_fingerprint(
            facts,
            shard,
            block_bytes=pages.block_bytes,
            parts=pages.parts,
            staged=pages.flat,
            pool_name=name,
        )
        named = (
            self.settings.tier_field
            if name == PoolName.KV
            else (lambda i: f"{self.settings.tier_field(i)} ({name} pool)")
        )
        tiers: list[SecondaryTier] = []
        try:
            for index, tier in enumerate(configs, start=1):
                tiers.append(tier.open_lower(pages.rows, fingerprint, field=named(index)))
            # one decision per page: a budget charges, and a sketch sizes by, a whole page
            admission = admission_filters(configs, pages.page_bytes, field=named)
        except BaseException:  # a budget contradicting the drive's size is found only at open
            for opened in tiers:
                opened.close()
            raise
        for index, kv in enumerate(shared_budgets):
            if kv.budget is not None:
                admission[index] = replace(admission[index], budget=kv.budget)
        with self._lock:
            store.tiers, store.admission = tiers, admission
        logger.info(
            "kvtier: %s pool, %s pages of %d tokens as %d block(s) of %d bytes (%s), shard %d%s, "
            "tiers %s; layout %s",
            name,
            facts.layout,
            facts.page_size,
            pages.parts,
            pages.block_bytes,
            "staged" if pages.staged else "in place",
            shard.shard,
            " (replicated: MLA)" if shard.replicated else "",
            ", ".join(f"{t.name} ({t.medium})" for t in tiers),
            fingerprint.describe(),
        )

    @property
    def tiers(self) -> list[SecondaryTier]:
        """The KV pool's tiers, fastest first, opened if they are not yet (for ``check()`` and
        tests)."""
        self._open_stores()
        kv = self._stores.get(PoolName.KV)
        return list(kv.tiers) if kv is not None else []

    def _kv(self) -> _PoolStore:
        """The KV pool's store, its tiers open (every page operation starts here)."""
        self._open_stores()
        kv = self._stores.get(PoolName.KV)
        if kv is None:
            raise KvtierError(
                "kvtier: no host pool registered yet; SGLang calls register_mem_pool_host first"
            )
        return kv

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

    def _page_keys(self, store: _PoolStore, key: str) -> list[OffloadKey]:
        return [page_key(key, store.shard.shard, part) for part in range(store.pages.parts)]

    def _page_starts(self, store: _PoolStore, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        page_size = store.pages.page_size
        if host_indices is None or int(host_indices.numel()) != len(keys) * page_size:
            self._warn_once(
                f"indices-{store.name}",
                "kvtier: %d keys with %s host slots (%s pages of %d tokens): call refused",
                len(keys),
                None if host_indices is None else int(host_indices.numel()),
                store.name,
                page_size,
            )
            return None
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    # -- pages in and out ------------------------------------------------------------------------

    def _move(
        self, store: _PoolStore, keys: Sequence[str], starts: Sequence[int], is_load: bool
    ) -> list[bool]:
        """Read (``is_load``) or store the pages at host slots ``starts``: in place, or through
        the staging buffer."""
        pages = store.pages
        if not pages.staged:
            rows = [pages.page_rows(start) for start in starts]
            return (self._load_rows if is_load else self._store_rows)(store, keys, rows)
        copy = pages.stage_in if is_load else pages.stage_out
        return self._staged(store, keys, is_load, lambda index, slot: copy(starts[index], slot))

    def _staged(
        self, store: _PoolStore, keys: Sequence[str], is_load: bool, copy: Callable[[int, int], None]
    ) -> list[bool]:
        """Move pages through the staging buffer, a few at a time: ``copy(index, slot)`` fills
        slot ``slot`` with page ``index`` before a store, or empties it after a verified load."""
        pages = store.pages
        results: list[bool] = []
        for begin in range(0, len(keys), pages.staging_pages):
            chunk = list(range(begin, min(len(keys), begin + pages.staging_pages)))
            slots = pages.acquire(len(chunk))
            try:
                if not is_load:
                    for index, slot in zip(chunk, slots):
                        copy(index, slot)
                rows = [pages.slot_rows(slot) for slot in slots]
                done = (self._load_rows if is_load else self._store_rows)(
                    store, [keys[i] for i in chunk], rows
                )
                if is_load:
                    for index, slot, ok in zip(chunk, slots, done):
                        if ok:
                            copy(index, slot)
                results += done
            finally:
                pages.release(slots)
        return results

    def _store_rows(self, store: _PoolStore, keys: Sequence[str], rows: Sequence[list[int]]) -> list[bool]:
        """Store each page (its parts in ``rows``) in every tier that admits it; a page is
        stored when one tier holds all of its parts."""
        started = time.perf_counter()
        stored = [False] * len(keys)
        refused = [False] * len(keys)
        page_keys = [self._page_keys(store, key) for key in keys]
        for tier, admission in zip(store.tiers, store.admission):
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
        self._count(store.stat("pages_stored"), done)
        self._count(
            store.stat("pages_store_failed"), sum(1 for s, r in zip(stored, refused) if not s and not r)
        )
        self._count(store.stat("pages_refused"), sum(1 for s, r in zip(stored, refused) if not s and r))
        self._record(store, "backup", done, time.perf_counter() - started)
        return stored

    def _load_rows(self, store: _PoolStore, keys: Sequence[str], rows: Sequence[list[int]]) -> list[bool]:
        """Read each page from the first tier that serves every part of it, verified."""
        started = time.perf_counter()
        loaded = [False] * len(keys)
        page_keys = [self._page_keys(store, key) for key in keys]
        corrupt = 0
        for tier in store.tiers:
            remaining = [i for i in range(len(keys)) if not loaded[i]]
            if not remaining:
                break
            if not self._defers(store):
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
        self._count(store.stat("pages_loaded"), done)
        self._count(store.stat("pages_load_failed"), len(keys) - done)
        self._count(store.stat("blocks_corrupt"), corrupt)
        self._record(store, "prefetch", done, time.perf_counter() - started)
        return loaded

    @staticmethod
    def _defers(store: _PoolStore) -> bool:
        """A replicated (MLA) rank that does not write: the writing rank stored its pages in
        the shared store after this process opened it, so this process's view lacks them.
        It answers "present" and reads them (loads resolve on the medium, and verify), and
        SGLang's minimum over ranks takes the writer's answer."""
        return store.shard.replicated and not store.shard.writer

    def _present(self, store: _PoolStore, keys: Sequence[str]) -> list[bool]:
        """Whether each page is held, every part of it in one tier."""
        if self._defers(store):
            return [True] * len(keys)
        page_keys = [self._page_keys(store, key) for key in keys]
        present = [False] * len(keys)
        for tier, admission in zip(store.tiers, store.admission):
            remaining = [i for i in range(len(keys)) if not present[i]]
            if not remaining:
                break
            with self._lock:
                for i in remaining:
                    admission.record(page_keys[i][0])
            flat = [key for i in remaining for key in page_keys[i]]
            answers = iter(self._lookup(tier, flat))
            for index in remaining:
                parts = [next(answers) for _ in page_keys[index]]
                present[index] = all(parts)
        return present

    def _exists(self, store: _PoolStore, keys: Sequence[str]) -> int:
        """How many pages from the first are held."""
        if not keys or not store.tiers:
            return 0
        present = self._present(store, keys)
        hits = present.index(False) if False in present else len(present)
        self._count(store.stat("exists_hit_pages"), hits)
        self._count(store.stat("exists_miss_pages"), len(keys) - hits)
        return hits

    def _record(self, store: _PoolStore, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0 or store.name != PoolName.KV:
            return
        nbytes = pages * store.pages.page_bytes
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # -- SGLang's page interface (v1: host slots, no copy) ----------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._exists(self._kv(), keys) if self._stores else 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._slots_io(self._kv(), keys, host_indices, is_load=True)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._slots_io(self._kv(), keys, host_indices, is_load=False)

    def _slots_io(self, store: _PoolStore, keys: list[str], host_indices: Any, is_load: bool) -> list[bool]:
        starts = self._page_starts(store, keys, host_indices)
        return [False] * len(keys) if starts is None else self._move(store, keys, starts, is_load)

    # -- v2: per pool (KV, and the extra pools registered) ----------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV prefix held, cut to where every extra pool holds its pages too (an extra
        pool's page is needed for each KV page: SGLang's ``ALL_PAGES``)."""
        kv_pages = self.batch_exists(keys)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        usable = kv_pages
        for transfer in pool_transfers or []:
            store = self._stores.get(str(transfer.name))
            if store is None or transfer.hit_policy != PoolHitPolicy.ALL_PAGES:
                # registration refuses the pools kvtier does not store; a transfer naming one
                # anyway holds no page, so no prefix can be restored with it
                self._warn_once(
                    str(transfer.name),
                    "kvtier does not store pool %s (%s)",
                    transfer.name,
                    transfer.hit_policy,
                )
                usable = 0
                continue
            pages = self._exists(store, keys[:kv_pages])
            if pages:
                hit_count[transfer.name] = pages
            usable = min(usable, pages)
        return PoolTransferResult(usable, hit_count, list(range(1, usable + 1)))

    def _batch_v2(self, transfers: list[PoolTransfer], is_load: bool) -> dict[str, list[bool]]:
        self._open_stores()
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            store = self._stores.get(str(transfer.name))
            if store is None:
                self._warn_once(str(transfer.name), "kvtier does not store pool %s", transfer.name)
                self._count("unsupported_pool_pages", len(keys))
                results[transfer.name] = [False] * len(keys)
            else:
                results[transfer.name] = self._slots_io(store, keys, transfer.host_indices, is_load)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, is_load=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, is_load=False)

    # -- the tensor forms (SGLang without interface_v1): flat pages through the staging buffer ---

    def _flat_pages(self, keys: Sequence[str], tensors: Any, what: str) -> _PoolStore | None:
        """The KV store when ``tensors`` are flat pages it can take, else None (warned once,
        counted): with ``interface_v1`` the tiers are open over the pool, with no staging."""
        store = self._kv()
        if tensors is None or len(tensors) != len(keys) or any(t is None for t in tensors):
            raise TypeError(f"kvtier: {what} needs one flat page tensor per key")
        if not store.pages.staged:
            self._warn_once(
                "tensor-forms",
                "kvtier: %s called with interface_v1 set, so the tiers are open over the host "
                "pool in place; SGLang calls batch_get_v1/batch_set_v1 then (refused)",
                what,
            )
            self._count("tensor_form_refused_pages", len(keys))
            return None
        if any(
            t.numel() * t.element_size() != store.pages.page_bytes or not t.is_contiguous() for t in tensors
        ):
            self._warn_once(
                "tensor-size", "kvtier: %s given a tensor that is not one flat page (refused)", what
            )
            self._count("tensor_form_refused_pages", len(keys))
            return None
        return store

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read page ``key`` into ``target_location`` (a flat page tensor); it, or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read each page into its flat page tensor; per page, the tensor or None."""
        store = self._flat_pages(keys, target_locations, "batch_get")
        if store is None:
            return [None] * len(keys)
        done = self._staged(store, keys, True, lambda i, slot: store.pages.take(slot, target_locations[i]))
        return [target if ok else None for target, ok in zip(target_locations, done)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (a flat page tensor, SGLang's get_data_page form) as page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each flat page tensor; whether every page was stored."""
        store = self._flat_pages(keys, values, "batch_set")
        if store is None:
            return False
        return all(self._staged(store, keys, False, lambda i, slot: store.pages.put(slot, values[i])))

    # -- stats and lifecycle ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """kvtier's counters: the backend's (``pages_stored``, ``pages_loaded``,
        ``pages_load_failed``, ``blocks_corrupt``, ``pages_refused``, ``exists_hit_pages`` ...)
        and each tier's as ``<tier>.<counter>``; after :meth:`close`, the last figures."""
        if not self._stores:
            return dict(self._final)
        with self._lock:
            figures: dict[str, float] = dict(self._counters)
            for store in self._stores.values():
                for tier, admission in zip(store.tiers, store.admission):
                    figures.update((f"{tier.name}.{k}", v) for k, v in tier.stats().items())
                    figures[f"{tier.name}.admitted"] = admission.admitted
                    figures[f"{tier.name}.refused"] = admission.refused
                    if admission.budget is not None and store.name == PoolName.KV:
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
        stores, self._stores = self._stores, {}
        tiers = [tier for store in stores.values() for tier in store.tiers]
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

"""``KvtierDiskTier``: a kvtier lower tier (lmdb, files, or a kind of your own) in vLLM 0.33's tiering.

vLLM's ``TieringOffloadingSpec`` keeps its own CPU tier (the primary, which the GPU workers
copy to and from) and cascades every stored chunk to a list of ``SecondaryTierManager``s,
promoting chunks back on a primary miss. This class is one of them, built by vLLM's
``SecondaryTierFactory`` from one entry of ``secondary_tiers``::

    {"type": "KvtierDiskTier", "module_path": "kvtier.integrations.vllm",
     "kind": "lmdb", "path": "/mnt/nvme/kvtier", "capacity": "2TiB",
     "eviction": "lru", "fsync": "batch", "o_direct": "auto"}

Everything but ``type``, ``module_path`` (the factory's), ``locality`` and ``backpressure``
(vLLM's) is a kvtier tier section, parsed by :func:`kvtier.load_config` exactly as in a
kvtier YAML, and built by its kind (``open_lower``): any kind that can sit below the first
tier, a kind from outside kvtier included (by class path in ``kind``). The
tier brings kvtier's capacity accounting and eviction, its index that survives restarts,
its checksummed block format (a block that fails verification is a miss, never served), and
its layout fingerprint (taken from vLLM's configuration).

vLLM's jobs map one to one onto kvtier's: a ``TransferJob`` names keys and primary chunk ids,
which are kvtier's CPU rows — the tier reads and writes vLLM's primary region in place,
through a numpy view of the memoryview vLLM hands it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.config import TierConfig, load_config
from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.vllm.manager import stats_to_vllm, to_vllm_event
from kvtier.integrations.vllm.settings import layout_fingerprint
from kvtier.tiers.base import SecondaryTier, TierJob, TierJobResult

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["DISK_STATS_METRIC", "VLLM_ENTRY_KEYS", "KvtierDiskTier", "parse_disk_tier_entry"]

logger = logging.getLogger("vllm.kvtier")

#: the Prometheus gauge mirroring the tier's statistics (labels: the tier's name, the figure)
DISK_STATS_METRIC = "vllm:kv_offload_kvtier_disk_stat"
#: how configuration errors name the section (vLLM's list index is not known here)
_SECTION = "secondary_tiers[KvtierDiskTier]"


def _rows_of(primary_kv_view: memoryview) -> np.ndarray:
    """vLLM's primary region as kvtier's CPU rows: ``(num_chunks, row_stride)`` uint8, no copy."""
    array = np.asarray(primary_kv_view)
    rows = array.view(np.uint8)
    if rows.ndim != 2:
        stride = primary_kv_view.strides[0]  # type: ignore[index]  # never None on Python 3
        rows = rows.reshape(-1, stride)
    return rows


#: keys of a secondary_tiers entry that belong to vLLM's factory and manager, not to kvtier
VLLM_ENTRY_KEYS = ("type", "module_path", "locality", "backpressure")


def parse_disk_tier_entry(entry: Mapping[str, Any], primary_bytes: int = 1 << 30) -> TierConfig:
    """The kvtier settings of one ``secondary_tiers`` entry, as its kind's section.

    Any kind that can sit below the first tier is accepted: ``lmdb`` and ``files``, or a
    kind of your own by class path (``"kind": "my_pkg.tiers:RemoteTierConfig"``; the
    ``module_path`` key of an entry is vLLM's, so the class path goes in ``kind``).

    Parsed by kvtier's own parser as tiers[1] below a stand-in cpu tier, so one set of rules
    (kinds, sizes, choices, typo suggestions) holds for a disk tier whether it is written in a
    kvtier YAML or in vLLM's secondary_tiers; only the field names in errors are rewritten to
    point at the entry (``secondary_tiers[KvtierDiskTier].capacity``). vLLM's own keys
    (``type``, ``module_path``, ``locality``, ``backpressure``) are skipped. The name defaults
    to ``disk``. Any thread; raises :class:`ConfigError`.
    """
    section = {"name": "disk"}
    section.update((k, v) for k, v in entry.items() if k not in VLLM_ENTRY_KEYS)
    stand_in = {"name": "vllm-primary", "kind": "cpu", "capacity": max(1, primary_bytes)}
    try:
        config = load_config({"tiers": [stand_in, section]})
    except ConfigError as error:
        field = error.field.replace("tiers[1]", _SECTION, 1)
        raise ConfigError(field, error.value, error.expected, error.fix) from None
    return config.tiers[1]


class KvtierDiskTier(SecondaryTierManager):
    """A kvtier disk tier (lmdb or files) below vLLM's CPU primary tier.

    Who calls it: vLLM's ``TieringOffloadingManager``, in the scheduler process, under its
    lock (from the scheduler thread, or its tier-poll thread for tiers that ask for it, which
    this one does not). Construction opens the store (blocks for the directory checks and the
    index scan; raises :class:`ConfigError` naming ``secondary_tiers[KvtierDiskTier].<key>``);
    :meth:`drain_jobs` and :meth:`shutdown` block; every other method is bookkeeping, the
    bytes moving on kvtier's I/O threads.

    vLLM guarantees a store job's chunks stay pinned, and a load job's chunks reserved, until
    this tier reports the job finished; kvtier's tier relies on exactly that.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            DISK_STATS_METRIC: OffloadingGaugeMetadata(
                documentation=(
                    "A kvtier disk tier's statistics (blocks, bytes written and read, jobs, "
                    "failed keys, corrupt blocks dropped, evictions); totals since start."
                ),
                labelnames=("kvtier_tier", "stat"),
            )
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_kind", "kvtier_path", "kvtier_capacity_bytes")

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **section: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        rows = _rows_of(primary_kv_view)
        #: the parsed section (kind, capacity, eviction, and the kind's own: path, fsync ...)
        self.config = parse_disk_tier_entry(section, rows.nbytes)
        fingerprint = layout_fingerprint(offloading_spec.config, rows.shape[1])
        self._tier: SecondaryTier | None = self.config.open_lower(rows, fingerprint, field=_SECTION)
        self._final_stats: dict[str, int] = {}
        self._events = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        #: vLLM job id -> whether it is a promotion (a load), until its result is handed over
        self._jobs: dict[int, bool] = {}
        logger.info(
            "kvtier disk tier %r (%s) at %s: %d blocks of %d bytes, layout %s",
            self.config.name,
            self.config.kind,
            self.config.location(),
            self._tier.capacity_blocks,
            self._tier.block_bytes,
            fingerprint.describe(),
        )

    @property
    def tier(self) -> SecondaryTier:
        """The kvtier tier (for its ``check()`` and tests); gone after :meth:`shutdown`."""
        if self._tier is None:
            raise KvtierError(f"kvtier disk tier {self.config.name!r} is shut down")
        return self._tier

    # -- the job API ----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.tier.lookup(key)
        if found is True:
            return LookupResult.HIT
        # being written by a job of this tier: vLLM's RETRY ("being transferred, ask later")
        return LookupResult.RETRY if found is None else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.touch(keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = tuple(job.keys)
        rows = tuple(int(row) for row in job.chunk_ids)
        tier_job = TierJob(job.job_id, keys, rows)
        self._jobs[job.job_id] = is_load
        if is_load:
            self.tier.submit_load(tier_job)
        else:
            self.tier.submit_store(tier_job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = [self._to_vllm(result) for result in self.tier.get_finished_jobs()]
        if not self._events:
            self.tier.take_events()  # nobody publishes them: do not let them pile up
        return results

    def _to_vllm(self, result: TierJobResult) -> JobResult:
        is_load = self._jobs.pop(result.job_id)
        successful: tuple[OffloadKey, ...] | None = None
        if result.failed and result.ok and is_load:
            # vLLM reads successful_keys for promotions only: keep the verified blocks, and
            # free (recompute) just the failed ones.
            successful = tuple(result.ok)
        if result.failed:
            logger.debug(
                "kvtier disk tier %r: %s job %d failed for %d keys (%s)",
                self.config.name,
                "load" if is_load else "store",
                result.job_id,
                len(result.failed),
                ", ".join(sorted({str(reason) for reason in result.failed.values()})),
            )
        return JobResult(
            job_id=result.job_id,
            success=not result.failed,
            successful_keys=successful,
            transfer_time=result.seconds,
            transfer_bytes=result.nbytes,
        )

    def drain_jobs(self) -> None:
        self.tier.drain_jobs()

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self.tier.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.tier.take_events()
        if not self._events:
            return ()
        return [to_vllm_event(event, self.locality) for event in events]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """kvtier's counters for this tier (blocks, bytes, jobs, failures, corrupt blocks ...);
        after :meth:`shutdown`, the last figures."""
        return self._tier.stats() if self._tier is not None else dict(self._final_stats)

    def get_stats(self) -> OffloadingConnectorStats | None:
        return stats_to_vllm(self.stats(), DISK_STATS_METRIC, (self.config.name,))

    def config_info(self) -> dict[str, str | int]:
        return {
            "kvtier_kind": self.config.kind,
            "kvtier_path": str(self.config.location()),
            "kvtier_capacity_bytes": self.config.capacity_bytes,
        }

    def shutdown(self) -> None:
        """Wait for jobs in flight, then close the store (files, threads, locks). Idempotent.

        Drops the tier, and with it the views of vLLM's primary region, so that vLLM can
        unmap the region right after (it shuts secondary tiers down first).
        """
        if self._tier is None:
            return
        tier, self._tier = self._tier, None
        try:
            tier.close()
        finally:
            self._final_stats = tier.stats()

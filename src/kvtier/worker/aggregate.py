"""One result per job from the results of every worker that ran a share of it.

Under tensor or pipeline parallelism each worker process copies its own shard of every job
(:mod:`kvtier.worker.shards`) and reports the job on its own. The scheduler side must act once
per job, and only when it knows the whole row: a block is ready when every rank's store of it
succeeded, a load is complete when every rank's load is, and one failed rank fails the job.

vLLM 0.33 does the counting itself (its connector scheduler waits for ``world_size``
completions of a job, summed by ``OffloadingWorkerMetadata.aggregate``); standalone drivers of
:class:`kvtier.TieredOffloadingSpec` use :class:`RankResultAggregator` for the same, plus the
failure vLLM's count cannot carry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.base import TransferResult

__all__ = ["RankResultAggregator"]


@dataclass
class _Partial:
    reported: set[int]
    success: bool
    nbytes: int
    time_s: float | None


class RankResultAggregator:
    """Combines the per-rank :class:`~kvtier.base.TransferResult` of each job into one.

    The combined result is emitted once every one of ``world_size`` ranks has reported the
    job: ``success`` if all succeeded, ``transfer_size`` the sum of the ranks' bytes (a rank
    that wrote nothing, as a replica of an MLA shard, adds 0), ``transfer_time`` the slowest
    rank's (ranks copy in parallel), ``None`` if any rank did not time its job.

    Who calls it: the driver's scheduler-side thread, with the results it collected from the
    workers; not thread-safe (hold your own lock). Never blocks.
    """

    def __init__(self, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self._partial: dict[int, _Partial] = {}

    def add(self, rank: int, results: Iterable[TransferResult]) -> list[TransferResult]:
        """Record ``rank``'s results; the jobs now complete on every rank, in the order their
        last report arrived.

        Raises ``ValueError`` for a rank outside ``[0, world_size)`` or a job the rank
        already reported (a bug in the driver: a job is reported once per rank).
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        done: list[TransferResult] = []
        for result in results:
            partial = self._partial.get(result.job_id)
            if partial is None:
                partial = self._partial[result.job_id] = _Partial(set(), True, 0, 0.0)
            if rank in partial.reported:
                raise ValueError(f"rank {rank} reported job {result.job_id} twice")
            partial.reported.add(rank)
            partial.success = partial.success and result.success
            partial.nbytes += result.transfer_size or 0
            if partial.time_s is not None and result.transfer_time is not None:
                partial.time_s = max(partial.time_s, result.transfer_time)
            else:
                partial.time_s = None
            if len(partial.reported) == self.world_size:
                del self._partial[result.job_id]
                done.append(
                    TransferResult(
                        result.job_id,
                        partial.success,
                        partial.nbytes if partial.success else 0,
                        partial.time_s,
                    )
                )
        return done

    def pending(self) -> dict[int, set[int]]:
        """Jobs some rank reported and others not yet: job id -> the ranks still to report."""
        everyone = set(range(self.world_size))
        return {job: everyone - p.reported for job, p in self._partial.items()}

"""The lower tiers' names in one place: the contract, its job types and the shared bookkeeping.

Each lives in its own module — :mod:`kvtier.tiers.contract` (:class:`SecondaryTier`, what every
tier below the CPU tier implements), :mod:`kvtier.tiers.jobs` (jobs, results, failures, check
reports) and :mod:`kvtier.tiers.indexed` (:class:`IndexedTier`, the bookkeeping most tiers
share) — and is re-exported here, where most code imports it from.
"""

from kvtier.tiers.contract import SecondaryTier
from kvtier.tiers.indexed import IndexedTier, TierCounters
from kvtier.tiers.jobs import CheckReport, Failure, FailureKind, TierJob, TierJobResult, TierWork

__all__ = [
    "CheckReport",
    "Failure",
    "FailureKind",
    "IndexedTier",
    "SecondaryTier",
    "TierCounters",
    "TierJob",
    "TierJobResult",
    "TierWork",
]

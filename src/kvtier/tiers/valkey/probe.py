"""A step's batch of reads (a probe) and what it found, key by key.

The scheduler thread sends the keys its lookups asked about as one :class:`Probe`; a worker
thread reads them and builds the :class:`ProbeOutcome` that the scheduler folds back in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.base import OffloadKey
from kvtier.tiers.jobs import Failure

__all__ = ["Probe", "ProbeOutcome"]


@dataclass
class Probe:
    """A step's batch of reads: its keys, and when the scheduler stops waiting for it."""

    keys: list[OffloadKey]
    deadline: float


@dataclass
class ProbeOutcome:
    """What a batch of reads found, key by key (built on a worker thread)."""

    batch: int
    #: key -> (value whose header passed, its payload checksum, checked on load)
    found: dict[OffloadKey, tuple[np.ndarray, int]] = field(default_factory=dict)
    missing: list[OffloadKey] = field(default_factory=list)
    #: key -> why its value is not this key's block of this layout (a ``CORRUPT`` failure)
    corrupt: dict[OffloadKey, Failure] = field(default_factory=dict)
    #: key -> why the server could not be asked
    failed: dict[OffloadKey, Failure] = field(default_factory=dict)

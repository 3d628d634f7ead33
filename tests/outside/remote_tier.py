"""A tier kind written outside kvtier, as a user's own package would write one.

kvtier holds no entry for it anywhere: a configuration names it by class path
(``kind: remote_tier:RemoteTierConfig``, or ``kind: RemoteTierConfig`` with ``module_path:
remote_tier``), and it is built from kvtier's public pieces only — :class:`TierConfig` for
its section, :class:`IndexedTier` for the scheduler-side bookkeeping. The tests put this
directory on ``sys.path`` and drive it through ``kvtier replay``, ``TieredOffloadingSpec`` and
vLLM's own tiering.

The "remote" store is a process-wide dict per ``mem://`` URL, standing in for a network
service: a tier reopened on the same URL finds the blocks a previous one left, and it has a
URL where a disk tier has a path. Each block is kept with a digest of the layout, its key and
its bytes, checked where the bytes land, so a damaged or foreign block is a miss.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtier.config import MISSING, TierConfig, non_empty_str, positive_int
from kvtier.errors import ConfigError
from kvtier.policies import get_policy_class
from kvtier.tiers.base import Failure, IndexedTier, TierWork

__all__ = ["BUCKETS", "RemoteTier", "RemoteTierConfig"]

#: url -> {key: (payload, digest)}: the "remote service", shared by every tier in the process
BUCKETS: dict[str, dict[bytes, tuple[bytes, bytes]]] = {}


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """The section of a ``remote_tier`` tier: where the service is, and one tuning knob."""

    # the service's address: mem://<bucket>
    url: str = ""
    # blocks per request to the service (a real client would batch its calls by this)
    batch_blocks: int = 64

    @classmethod
    def parse_options(cls, section, field, name):
        url = non_empty_str(
            section.get("url", MISSING),
            f"{field}.url",
            "a service URL such as mem://shared",
            "add url: mem://<bucket>",
        )
        if not url.startswith("mem://"):
            raise ConfigError(f"{field}.url", url, "a mem:// URL", "write url: mem://<bucket>")
        options = {"url": url}
        if "batch_blocks" in section:
            options["batch_blocks"] = positive_int(section["batch_blocks"], f"{field}.batch_blocks")
        return options

    def location(self):
        return self.url

    def open_lower(self, rows, fingerprint, *, field, **options):
        return RemoteTier(self, rows, fingerprint.digest())


class RemoteTier(IndexedTier):
    """Blocks in ``BUCKETS[url]``; jobs run when polled (the service answers at once)."""

    medium = "REMOTE"

    def __init__(self, config: RemoteTierConfig, rows: np.ndarray, layout_digest: bytes):
        block_bytes = rows.shape[1]
        capacity = config.capacity_bytes // block_bytes
        policy = get_policy_class(config.eviction, config.eviction_module_path)(capacity)
        super().__init__(config.name, block_bytes, capacity, policy)
        self._rows = rows
        self._layout = layout_digest
        self._bucket = BUCKETS.setdefault(config.url, {})
        self._queue: deque[TierWork] = deque()
        known = list(self._bucket)[:capacity]  # what an earlier tier on this URL left
        self._policy.insert(known, [0] * len(known))

    def _digest(self, key: bytes, payload) -> bytes:
        return hashlib.blake2b(self._layout + key + bytes(payload), digest_size=16).digest()

    def _start_store(self, work: TierWork) -> None:
        for key in work.victims:
            self._bucket.pop(key, None)
        self._queue.append(work)

    def _start_load(self, work: TierWork) -> None:
        self._queue.append(work)

    def _finished_work(self) -> list[TierWork]:
        done = list(self._queue)
        self._queue.clear()
        for work in done:
            for index, (key, row) in enumerate(zip(work.keys, work.rows)):
                if work.is_load:
                    work.reasons[index] = self._get(key, row)
                else:
                    payload = self._rows[row].tobytes()
                    self._bucket[key] = (payload, self._digest(key, payload))
        return done

    def _get(self, key: bytes, row: int) -> Failure | None:
        entry = self._bucket.get(key)
        if entry is None:
            return Failure.MISSING
        payload, digest = entry
        if len(payload) != self.block_bytes:  # cut short or grown: it cannot fill the row
            del self._bucket[key]
            return Failure.corrupt("truncated" if len(payload) < self.block_bytes else "payload length")
        self._rows[row] = np.frombuffer(payload, dtype=np.uint8)
        if self._digest(key, self._rows[row]) != digest:
            del self._bucket[key]
            return Failure.corrupt("digest")
        return None

    def drain_jobs(self) -> None:
        """Nothing runs in the background: queued jobs finish at the next poll."""

    def has_pending_work(self) -> bool:
        return bool(self._queue) or super().has_pending_work()

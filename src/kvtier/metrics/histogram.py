"""A fixed-bucket latency histogram, cheap enough to record every tier job.

Recording is one ``bisect`` over a tuple of bounds and two additions: no object is made per
observation, so the manager records each load and store job it polls. The bounds are
Prometheus's ``le`` buckets (seconds); ``+Inf`` is implied by ``count``.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["JOB_SECONDS_BUCKETS", "LatencyHistogram"]

#: upper bounds (seconds) of the job latency buckets: 100 us (a page-cache hit) to 10 s (a
#: stalled disk or a remote tier in trouble), about three per decade
JOB_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class LatencyHistogram:
    """Counts of observations per bucket, their sum and their number.

    One thread records (the scheduler's, for the manager's jobs); a scrape on another thread
    may read a figure one observation old, never a torn one (each is a single int or float).
    """

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...] = JOB_SECONDS_BUCKETS):
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram bounds must be increasing and distinct, got {bounds!r}")
        self.bounds = bounds
        #: observations per bucket (not cumulative); the last slot is above every bound
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, observations <= le)`` per bound, then ``(inf, count)``: Prometheus's buckets."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append((bound, running))
        out.append((float("inf"), running + self.counts[-1]))
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated within its bucket as Prometheus's
        ``histogram_quantile`` does (None with no observation)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"a quantile is between 0 and 1, got {q}")
        buckets = self.cumulative()
        total = buckets[-1][1]
        if total == 0:
            return None
        rank = q * total
        lower, below = 0.0, 0
        for bound, running in buckets:
            if running >= rank:
                if bound == float("inf"):
                    return lower  # above the last bound: its value is all Prometheus knows
                inside = running - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, running
        return lower

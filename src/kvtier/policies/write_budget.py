"""A tier's write budget: how many bytes per second it may write, and the reuse bar that keeps it there.

``admit: budget`` (see :class:`~kvtier.policies.admission.AdmissionFilter`) writes a block
below only when this controller says so. Two parts (docs/design/write-budget.md says why):

* **a token bucket**, the hard bound: ``budget_bytes_per_s`` flows in, up to ``window_s``
  seconds' worth, and each admitted block takes its bytes out; a block never passes an empty
  bucket, so the bytes written over any span stay within the budget plus the bucket;
* **a reuse threshold**, the choice: the blocks offered for writing are counted by their
  reuse estimate (a histogram decaying over :data:`HISTOGRAM_WINDOWS` windows), and the
  threshold is set where the blocks above it would write the budget's rate — nudged up
  while the bucket is below half full and down while above (a quarter of the difference a
  window), so it settles half full. The
  threshold is fractional: a block seen ``n`` times passes ``t`` when ``n + draw >= t``, the
  draw in [0, 1) being the phase of a :data:`DITHER_S` cycle of the clock (:meth:`phase`), so
  the blocks at the margin go in spells of time, whole prefixes together, not scattered.

Where the drive's own write counter is readable (``device_written``), the bytes it wrote
beyond the tier's own (other writers, headers, the index) are taken out of the bucket too.

Times come from ``clock`` (seconds; ``time.monotonic`` by default), injectable so tests and
``kvtier replay`` (its trace's time) drive it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["HISTOGRAM_WINDOWS", "MAX_ESTIMATE", "SECONDS_PER_YEAR", "WriteBudget", "time_draw"]

#: reuse estimates are counted up to this (higher ones count as this): the threshold moves
#: between 1 (every block) and MAX_ESTIMATE + 1 (none)
MAX_ESTIMATE = 15
#: the bucket fill the threshold steers to: room to absorb a burst, budget banked for one
TARGET_FILL = 0.5
#: the share of the bucket's distance from TARGET_FILL that the threshold lets through (or
#: holds back) on top of a window's budget: the bank is evened out over about four windows.
#: 1 made the threshold swing with each burst and wrote fewer reused blocks (design doc)
BANK_GAIN = 0.25
#: the windows the offers' histogram decays over: a longer memory of the reuse mix than the
#: bucket's, so quiet minutes do not pull the threshold down to blocks seen once that the
#: busy minutes after would have needed the bank for. At half the unthrottled rate on the
#: bundled trace, 0.010 more hit ratio than a fixed min_reuse writing the same bytes (1:
#: 0.0015), writing 0.951 of the budget (1: 0.989) (design doc, "The histogram's memory")
HISTOGRAM_WINDOWS = 3.0
SECONDS_PER_YEAR = 365.25 * 86400
#: the cycle (seconds of the clock) whose phase is the draw of the blocks at a fractional
#: threshold: blocks written about the same time — a request's prefix — share one decision.
#: A draw fixed per key (CRC-32) refused scattered blocks of every prefix, each cutting the
#: prefix a lookup can hit: 0.548 against 0.564 at half the unthrottled rate (design doc)
DITHER_S = 60.0
#: the drive's counter is read at most this often (seconds of the clock): a file read per
#: scheduler step would cost more than the rest of the controller
DEVICE_READ_INTERVAL_S = 1.0


def time_draw(now: float) -> float:
    """The draw of blocks offered at clock time ``now`` (seconds): where it is in its
    :data:`DITHER_S` cycle, in [0, 1). A block seen ``n`` times passes a fractional
    threshold ``t`` when ``n + draw >= t``, so blocks offered together pass or fail together."""
    return now / DITHER_S % 1.0


class WriteBudget:
    """A write budget of ``budget_bytes_per_s``, its bucket holding ``window_s`` seconds of it.

    The owning manager calls :meth:`admit` for each block it would write (with the block's
    reuse estimate and the draw, :meth:`phase`), :meth:`wrote` with the
    bytes each finished job wrote, and :meth:`tick` once per scheduler step; all O(1), on the
    scheduler thread. ``endurance_bytes`` (the drive's rated writes, or None) gives
    :meth:`projected_life_years`.
    """

    def __init__(
        self,
        budget_bytes_per_s: float,
        window_s: float,
        endurance_bytes: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        device_written: Callable[[], int | None] | None = None,
    ):
        if not budget_bytes_per_s > 0 or not window_s > 0:
            raise ValueError(
                f"a write budget needs a positive rate and window, got {budget_bytes_per_s}, {window_s}"
            )
        self.budget_bytes_per_s = float(budget_bytes_per_s)
        self.window_s = float(window_s)
        self.endurance_bytes = endurance_bytes
        #: the bucket's size in bytes
        self.capacity_bytes = self.budget_bytes_per_s * self.window_s
        #: the reuse a block needs now (fractional; 1.0 admits every block)
        self.threshold = 1.0
        self.admitted_bytes = 0
        self._own_bytes = 0
        self._device_written = device_written
        self._restart(clock)

    def _restart(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        now = clock()
        self._started = self._refilled = self._ticked = now
        # Half full: the level the threshold steers to, so a run that ends near it has written
        # its budget, no more (the burst) and no less.
        self._tokens = self.capacity_bytes * TARGET_FILL
        #: bytes offered for writing by reuse estimate (index 1..MAX_ESTIMATE), each decaying
        #: by e per HISTOGRAM_WINDOWS windows since it was offered
        self._offered = [0.0] * (MAX_ESTIMATE + 1)
        #: when the first block was offered (the histogram's age counts from it); None: not yet
        self._first_offer: float | None = None
        self._own_base = self._own_bytes
        self._device_base = self._device_written() if self._device_written is not None else None
        self._device_last, self._device_read_at = self._device_base, now
        self._other_max = 0
        self._counted_at_tick = 0
        self._rate_sum = 0.0  # exponentially weighted bytes per second, not yet bias-corrected

    def use_clock(self, clock: Callable[[], float], *, count_device: bool = True) -> None:
        """Count time from ``clock`` from now on (the bucket starts half full again).
        ``count_device=False`` drops the drive's counter: its bytes accrue in wall time, which
        means nothing against a clock of another time (a replay's trace time)."""
        if not count_device:
            self._device_written = None
        self._restart(clock)

    # -- the scheduler's calls ----------------------------------------------------------------

    def phase(self) -> float:
        """The draw for blocks offered now: where the clock is in its :data:`DITHER_S`
        cycle, in [0, 1)."""
        return time_draw(self._clock())

    def admit(self, estimate: int, draw: float, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` seen ``estimate`` times may be written now; ``draw``
        in [0, 1) (:meth:`phase`, as :class:`~kvtier.policies.admission.AdmissionFilter`
        passes it) splits the blocks at a fractional threshold (1.4 admits every block seen
        twice and, 60% of the time, those seen once)."""
        estimate = max(1, min(estimate, MAX_ESTIMATE))
        if self._first_offer is None:
            self._first_offer = self._clock()
        self._offered[estimate] += nbytes
        self._refill()
        self.threshold = self._threshold()
        if self._tokens < nbytes or estimate + draw < self.threshold:
            return False
        self._tokens -= nbytes
        self.admitted_bytes += nbytes
        return True

    def wrote(self, nbytes: int) -> None:
        """A job of this tier finished writing ``nbytes``."""
        self._own_bytes += nbytes

    def tick(self) -> None:
        """Refill; count the drive's other writes against the bucket; age the offers; update
        the rate seen and the threshold."""
        self._refill()
        counted = self.written_bytes()
        other = counted - (self._own_bytes - self._own_base)
        if other > self._other_max:
            # The drive wrote more than the tier did: others' writes and the store's own
            # overhead. Against a running maximum, so a device count lagging the tier's (the
            # page cache not yet flushed) is not taken twice when it catches up.
            # (into debt if need be: the writes happened, and the tier waits them out)
            self._tokens -= other - self._other_max
            self._other_max = other
        now = self._clock()
        span = now - self._ticked
        if span > 0:
            weight = math.exp(-span / self.window_s)
            self._rate_sum = weight * self._rate_sum + (1 - weight) * (counted - self._counted_at_tick) / span
            fading = math.exp(-span / (HISTOGRAM_WINDOWS * self.window_s))
            self._offered = [fading * offered for offered in self._offered]
            self._counted_at_tick = counted
            self._ticked = now
        self.threshold = self._threshold()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._refilled:
            self._tokens = min(
                self.capacity_bytes, self._tokens + (now - self._refilled) * self.budget_bytes_per_s
            )
            self._refilled = now

    def _threshold(self) -> float:
        """The threshold at which the blocks offered lately would have written the budget's
        bytes of the same span, plus what the bucket holds beyond half (or less what it lacks)."""
        offered = self._offered
        total = sum(offered)
        if total <= 0:
            return 1.0
        assert self._first_offer is not None  # there are offers
        seen = max(self._clock(), self._ticked) - self._first_offer
        # the offers' span (their weights decay by e per HISTOGRAM_WINDOWS windows), at first
        # as long as the half bucket the budget starts with, which the first offers may spend
        memory = HISTOGRAM_WINDOWS * self.window_s
        span = max(TARGET_FILL * self.window_s, -memory * math.expm1(-seen / memory))
        bank = self._tokens - self.capacity_bytes * TARGET_FILL
        # the bank's pull, BANK_GAIN of it a window, over the histogram's windows
        allowed = self.budget_bytes_per_s * span + BANK_GAIN * HISTOGRAM_WINDOWS * bank
        if allowed >= total:
            return 1.0
        if allowed <= 0:
            return MAX_ESTIMATE + 1.0  # the bucket is short of even the span's budget
        # Walk down from the most reused: blocks seen more than k times all pass a threshold
        # in (k, k + 1], those seen k times the share k + 1 - t of them.
        above = 0.0
        for k in range(MAX_ESTIMATE, 0, -1):
            if offered[k] > 0 and above + offered[k] >= allowed:
                return k + 1 - (allowed - above) / offered[k]
            above += offered[k]
        return 1.0

    # -- what it reports ---------------------------------------------------------------------

    @property
    def counts_device(self) -> bool:
        """Whether the drive's own write counter is what is counted."""
        return self._device_written is not None and self._device_base is not None

    def written_bytes(self) -> int:
        """Bytes written since the budget started: the drive's count where it has one (read
        at most every DEVICE_READ_INTERVAL_S; a failed read keeps the last), else the tier's
        own."""
        if self._device_written is not None and self._device_base is not None:
            at = self._clock()
            if at - self._device_read_at >= DEVICE_READ_INTERVAL_S or at < self._device_read_at:
                found = self._device_written()
                if found is not None:  # unreadable for a moment: the last reading stands
                    self._device_last, self._device_read_at = found, at
            assert self._device_last is not None
            return self._device_last - self._device_base
        return self._own_bytes - self._own_base

    def write_bytes_per_s(self) -> float:
        """The write rate seen, averaged over about ``window_s`` (weights decaying by e each
        window; corrected for the start, where fewer seconds were seen)."""
        seen = self._ticked - self._started
        if seen <= 0:
            return 0.0
        return self._rate_sum / -math.expm1(-seen / self.window_s)

    def projected_life_years(self) -> float | None:
        """Years until the drive's rated endurance is written at the rate seen; None without
        an endurance figure or before anything was written."""
        rate = self.write_bytes_per_s()
        if self.endurance_bytes is None or rate <= 0:
            return None
        return self.endurance_bytes / rate / SECONDS_PER_YEAR

    def stats(self) -> dict[str, float]:
        """The tier's budget figures (``<tier>.<name>`` in the manager's stats)."""
        figures = {
            "budget_bytes_per_s": self.budget_bytes_per_s,
            "write_bytes_per_s": round(self.write_bytes_per_s(), 3),
            "admit_threshold": round(self.threshold, 3),
            "device_written_bytes": self.written_bytes(),
        }
        life = self.projected_life_years()
        if life is not None:
            figures["projected_life_years"] = round(life, 3)
        return figures

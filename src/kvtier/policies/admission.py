"""Admission to a lower tier: write a block below only once it has proven reuse (TinyLFU style),
or, under a write budget, once its reuse clears the bar the budget sets."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.policies.write_budget import WriteBudget, time_draw

__all__ = ["ADMIT_MODES", "AdmissionFilter", "CountMinSketch", "check_min_reuse"]

#: ``admit`` values of a lower tier's configuration
ADMIT_MODES = ("all", "reuse", "budget")
#: rows of the sketch: the estimate is the least of these counters
_DEPTH = 4
#: a counter never goes past this (a byte; reuse thresholds are small)
_SATURATE = 255


class CountMinSketch:
    """Approximate counts of keys in a fixed number of bytes, never below the true count.

    ``_DEPTH`` rows of ``width`` one-byte counters; a key adds one to a counter in each row
    (positions from its hash, by double hashing) and its estimate is the least of them, so
    collisions can only inflate it. After ``10 * width`` additions every counter is halved
    (TinyLFU's reset): old popularity fades, and the cost — one pass over the table — is O(1)
    amortized per addition. Memory: ``_DEPTH * width`` bytes, whatever the number of keys.

    Keys are hashed with Python's ``hash``: counts live for one process only.
    """

    def __init__(self, width: int):
        if width < 1:
            raise ConfigError("sketch width", width, "a positive number of counters", "e.g. 4096")
        self.width = 1 << (width - 1).bit_length()  # a power of two: masking, not modulo
        self._mask = self.width - 1
        self._rows = [bytearray(self.width) for _ in range(_DEPTH)]
        self._added = 0
        self._reset_after = 10 * self.width

    def _positions(self, key: Hashable) -> list[int]:
        h = hash(key)
        step = ((h >> 32) | 1) & 0xFFFFFFFF  # odd, so the rows' positions differ
        mask = self._mask
        return [(h + i * step) & mask for i in range(_DEPTH)]

    def add(self, key: Hashable) -> int:
        """Count one more occurrence of ``key``; its new estimate."""
        least = _SATURATE
        for row, at in zip(self._rows, self._positions(key)):
            value = row[at]
            if value < _SATURATE:
                value += 1
                row[at] = value
            least = min(least, value)
        self._added += 1
        if self._added >= self._reset_after:
            self._halve()
        return least

    def estimate(self, key: Hashable) -> int:
        """How many times ``key`` was counted (at least; halved by each reset)."""
        return min(row[at] for row, at in zip(self._rows, self._positions(key)))

    def _halve(self) -> None:
        halve = bytes(value >> 1 for value in range(256))  # a translation table: C-level
        self._rows = [bytearray(row.translate(halve)) for row in self._rows]
        self._added = 0


def check_min_reuse(value: object, field: str) -> float:
    """``value`` as a ``min_reuse``: a number of sightings, at least 1 (may be fractional);
    a :class:`ConfigError` naming ``field`` otherwise."""
    number: float | None = None
    if not isinstance(value, bool) and isinstance(value, numbers.Real):  # numpy's numbers too
        number = float(value)
    if number is None or not 1 <= number <= _SATURATE:
        raise ConfigError(
            field,
            value,
            f"a number of sightings from 1 to {_SATURATE} (fractional allowed)",
            "2 writes a block below once it was seen twice; 1.5 also writes blocks seen once "
            "half of the time",
        )
    # numpy's numbers as Python's; a whole number stays an int (as the config shows it)
    return int(number) if isinstance(value, numbers.Integral) else number


@dataclass
class AdmissionFilter:
    """Decides which blocks a lower tier takes: all of them, those seen ``min_reuse`` times, or
    (``mode="budget"``) those whose count clears the threshold ``budget`` sets.

    The manager calls :meth:`record` when a key is offered for storing or looked up, and
    :meth:`admit` when a block is about to be written to the tier. With ``mode="reuse"`` a
    block is admitted once its key was recorded at least ``min_reuse`` times (an estimate
    from a bounded :class:`CountMinSketch`, so a one-off block never reaches flash, and a
    collision can only admit early, never refuse a block that earned its place).
    ``min_reuse`` may be fractional, a fixed threshold of the budget's kind: 1.8 admits every
    block seen twice and, 20% of the time (in spells of the ``clock``'s minute, see
    :func:`~kvtier.policies.write_budget.time_draw`), those seen once.

    With ``mode="budget"`` the threshold is the :class:`WriteBudget`'s, fractional (the
    budget's :meth:`~kvtier.policies.write_budget.WriteBudget.phase` is added to the count,
    so a prefix's blocks, written together, pass or fail together), and a block is admitted
    only while the budget has ``block_bytes`` left for it.

    Who calls it: the owning manager, on the scheduler thread; every call O(1).
    """

    mode: str = "all"
    min_reuse: float = 2
    #: counters per sketch row; a few per block the tier can hold is plenty
    sketch_width: int = 1 << 16
    admitted: int = 0
    refused: int = 0
    #: with mode "budget": the controller, and the bytes one block costs it
    budget: WriteBudget | None = None
    block_bytes: int = 0
    #: seconds, for the draw of a fractional ``min_reuse`` (a replay sets its trace's clock)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.mode not in ADMIT_MODES:
            raise ConfigError(
                "admit",
                self.mode,
                "one of " + ", ".join(ADMIT_MODES),
                "use admit: reuse to keep one-off blocks off the tier",
            )
        self.min_reuse = check_min_reuse(self.min_reuse, "min_reuse")
        if (self.mode == "budget") != (self.budget is not None):
            raise ValueError("a WriteBudget goes with mode 'budget', and only with it")
        self._sketch = CountMinSketch(self.sketch_width) if self.counts_sightings else None

    @property
    def counts_sightings(self) -> bool:
        """Whether :meth:`record` counts anything (the manager skips the calls otherwise)."""
        return self.mode != "all"

    def record(self, key: Hashable) -> None:
        """``key`` was offered for storing or looked up."""
        if self._sketch is not None:
            self._sketch.add(key)

    def admit(self, key: Hashable) -> bool:
        """Whether the block of ``key`` may be written to the tier now (counted either way)."""
        if self.budget is not None:
            assert self._sketch is not None
            budget = self.budget
            ok = budget.admit(self._sketch.estimate(key), budget.phase(), self.block_bytes)
        elif self._sketch is None:
            ok = True
        else:
            seen, bar = self._sketch.estimate(key), self.min_reuse
            # an integral bar needs no draw: seen is whole, so seen + draw >= bar iff seen >= bar
            ok = seen >= bar or (seen + 1 > bar and seen + time_draw(self.clock()) >= bar)
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
        return ok

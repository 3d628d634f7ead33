"""Why a lookup missed: a bounded sketch of what each key went through, and the cause counters.

:class:`CauseSketch` remembers, for up to ``keys`` offload keys, the last thing that happened
to each (stored below, evicted by a tier, refused by a tier's admission, a store that failed,
a read that failed verification, a tier that could not be reached), in about 6.6 bytes a
key: a table of 4-way buckets (a quarter more slots than ``keys``), each key in the emptier
of two, each slot a 32-bit tag of the key and one byte of event and tier, plus a one-byte
replacement cursor per bucket. A key it never saw matches a remembered tag with probability
at most ``1 - (1 - 2**-32)**8`` (1.9e-9, :attr:`CauseSketch.error_rate`); a key that finds
both its buckets full replaces an entry of the first in turn (round robin: roughly the oldest;
``forgotten``: about 1.4% of the keys by the time ``keys`` are held), which then reads as
never seen. Why this table and not a
Bloom or cuckoo filter: docs/design/miss-causes.md.

:class:`MissCauses` is what a manager holds: the sketch and the counters ``stats()`` shows
(``miss_<cause>``, ``<tier>.miss_<cause>``, ``foreign_<part>``). Every lookup answered
``False`` for want of the block, and every read from below that failed, is counted under
exactly one of :data:`CAUSES`.

Threading: the engine's scheduler thread only, like the managers that hold it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import xxhash

from kvtier.base import OffloadKey
from kvtier.tiers.jobs import Failure, FailureKind

__all__ = ["CAUSES", "FOREIGN_PARTS", "CauseSketch", "MissCauses", "failure_cause"]

#: every cause a miss is counted under (stats ``miss_<cause>``)
CAUSES = ("new", "evicted", "refused", "store_failed", "corrupt", "unavailable", "filtered", "foreign")
#: the parts of a block's identity a ``foreign`` miss can name (stats ``foreign_<part>``)
FOREIGN_PARTS = ("layout", "tp", "namespace", "secret", "codec")

# What the sketch remembers of a key (the high 3 bits of its byte; the low 5 bits hold the
# tier's index in the stack, 0 the first tier, or for FOREIGN the part's index).
STORED = 1  # a tier below the first holds it (the tier that stored it last)
EVICTED = 2  # the tier that let it go last
REFUSED = 3  # a tier's admission would not take it
FAILED = 4  # a tier could not take it (full, ENOSPC, EIO ...)
CORRUPT = 5  # found, but failed verification when read
UNAVAILABLE = 6  # the tier could not be reached when it was stored or read
FOREIGN = 7  # found under another layout or secret (the part in the low bits)
_WHY_NOT_BELOW = (REFUSED, FAILED, CORRUPT, UNAVAILABLE, FOREIGN)
_CAUSE_OF = {
    STORED: "evicted",  # held below once and gone now: the tier let it go unseen (a server's own eviction)
    EVICTED: "evicted",
    REFUSED: "refused",
    FAILED: "store_failed",
    CORRUPT: "corrupt",
    UNAVAILABLE: "unavailable",
    FOREIGN: "foreign",
}
_READ_RECORD = {"evicted": EVICTED, "corrupt": CORRUPT, "unavailable": UNAVAILABLE}
MAX_TIERS = 31  # the low 5 bits of a record

_WAYS = 4
_TAG_BITS = 32
_SEED = 0x6B76746965720001  # fixed: the same keys land in the same slots run after run


def failure_cause(reason: Failure) -> tuple[str, str | None]:
    """The miss cause of a read from below that failed with ``reason``, and the foreign part
    where it is ``foreign``.

    A block that failed verification because it was written under another layout, with
    another codec, under another secret (its header's key id), or with or without a secret
    where this tier has the other, is ``foreign`` (its header says so); a bad MAC under this secret's key id (or in a
    block written before key ids, which has none) is ``corrupt``, as is every other failed
    check. A block gone from the tier was let go (``evicted``); any other failure
    (unreachable, refused credentials, an I/O error) means the tier could not serve it:
    ``unavailable``.
    """
    kind = reason.kind
    if kind is FailureKind.CORRUPT:
        if reason.detail == "other layout":
            return "foreign", "layout"
        if reason.detail in ("unkeyed", "keyed (no secret here)", "other secret"):
            return "foreign", "secret"
        if reason.detail == "other codec":
            return "foreign", "codec"
        return "corrupt", None
    if kind is FailureKind.MISSING:
        return "evicted", None
    return "unavailable", None


#: failures of a store that say the server was out of reach (else: the tier could not take it)
_OUT_OF_REACH = frozenset((FailureKind.UNAVAILABLE, FailureKind.AUTH, FailureKind.TLS, FailureKind.DENIED))


def _store_record(reason: Failure) -> int:
    """The sketch's record of a key a tier's store job failed with ``reason``."""
    return UNAVAILABLE if reason.kind in _OUT_OF_REACH else FAILED


class CauseSketch:
    """A fixed table remembering one record byte for each of up to ``keys`` keys.

    ``tag_bits`` (at most 32) trades memory-free accuracy for testing: with fewer bits the
    false-match rate is large enough to measure (tests/manager/test_causes.py).
    """

    def __init__(self, keys: int, *, tag_bits: int = _TAG_BITS, seed: int = _SEED):
        if keys < _WAYS:
            raise ValueError(f"a cause sketch remembers at least {_WAYS} keys, got {keys}")
        if not 1 <= tag_bits <= 32:
            raise ValueError(f"tag_bits must be 1 to 32, got {tag_bits}")
        self._keys = keys
        # a quarter more slots than keys: two-choice buckets of 4 then forget ~1.4% of the
        # keys at `keys` held (at 100% load they would forget 8%)
        self._buckets = -(-(keys * 5 // 4) // _WAYS)
        slots = self._buckets * _WAYS
        self._tags = array("I", bytes(4 * slots))
        self._records = array("B", bytes(slots))
        self._cursor = array("B", bytes(self._buckets))
        self._shift = 128 - tag_bits  # the top bits of the 128-bit hash; buckets use the low 64
        self._seed = seed
        self.tag_bits = tag_bits
        #: records overwritten to make room for another key (that key now reads as never seen)
        self.forgotten = 0

    @property
    def keys(self) -> int:
        """How many keys it is sized to remember at once."""
        return self._keys

    @property
    def nbytes(self) -> int:
        """Bytes its tables hold (the tags, the records, the cursors)."""
        return (
            self._tags.itemsize * len(self._tags)
            + self._records.itemsize * len(self._records)
            + self._cursor.itemsize * len(self._cursor)
        )

    @property
    def error_rate(self) -> float:
        """The most likely a key it never saw is taken for one it did (a tag match in one
        of the 8 slots of its two buckets: ``1 - (1 - 2**-tag_bits)**8``)."""
        return 1.0 - (1.0 - 2.0**-self.tag_bits) ** (2 * _WAYS)

    def _place(self, key: OffloadKey) -> tuple[int, int, int]:
        """``(first slot of the key's first bucket, of its second, its non-zero tag)``."""
        digest = xxhash.xxh3_128_intdigest(key, self._seed)
        tag = (digest >> self._shift) or 1  # 0 marks an empty slot
        buckets = self._buckets
        return (digest & 0xFFFFFFFF) % buckets * _WAYS, (digest >> 32 & 0xFFFFFFFF) % buckets * _WAYS, tag

    def get(self, key: OffloadKey) -> int:
        """The key's record byte (event << 5 | tier), or 0 if not remembered."""
        first, second, tag = self._place(key)
        tags = self._tags
        # a slice and `in` scan a bucket in C: half the time of four indexings
        bucket = tags[first : first + _WAYS]
        if tag in bucket:
            return self._records[first + bucket.index(tag)]
        bucket = tags[second : second + _WAYS]
        if tag in bucket:
            return self._records[second + bucket.index(tag)]
        return 0

    def put(self, keys: Iterable[OffloadKey], event: int, tier: int) -> None:
        """Remember ``event`` at ``tier`` for each of ``keys``, by the rules of
        :meth:`_merge` (a later event replaces an earlier one, except where the earlier
        one still explains why the block is not below)."""
        tags, records, place, merge = self._tags, self._records, self._place, self._merge
        new = event << 5 | tier
        for key in keys:
            first, second, tag = place(key)
            one = tags[first : first + _WAYS]
            if tag in one:
                slot = first + one.index(tag)
                records[slot] = merge(records[slot], event, tier, new)
                continue
            two = tags[second : second + _WAYS]
            if tag in two:
                slot = second + two.index(tag)
                records[slot] = merge(records[slot], event, tier, new)
                continue
            # an empty slot (tag 0) of the emptier bucket; both full: the first's entries go in
            # turn (round robin, so roughly the oldest)
            empty_one, empty_two = one.count(0), two.count(0)
            if empty_one and empty_one >= empty_two:
                slot = first + one.index(0)
            elif empty_two:
                slot = second + two.index(0)
            else:
                bucket = first // _WAYS
                turn = self._cursor[bucket]
                self._cursor[bucket] = (turn + 1) % _WAYS
                self.forgotten += 1
                slot = first + turn
            tags[slot] = tag
            records[slot] = new

    @staticmethod
    def _merge(old: int, event: int, tier: int, new: int) -> int:
        """The record after ``event`` at ``tier`` happened to a key whose record is ``old``.

        * a tier's eviction keeps a record that says why the block is not below (refused,
          failed, corrupt, unreachable, foreign: taking it would have kept it), and a record
          that another tier holds it; else the evicting tier is the last holder;
        * a refusal or failure keeps a record that another tier holds it;
        * a store, a corrupt read, an unreachable tier: always the newest news.
        """
        old_event, old_tier = old >> 5, old & 31
        if event == EVICTED:
            if old_event in _WHY_NOT_BELOW or (old_event == STORED and old_tier != tier):
                return old
        elif event in (REFUSED, FAILED) and old_event == STORED and old_tier != tier:
            return old
        return new


class MissCauses:
    """The miss-cause counters of one manager, and its :class:`CauseSketch`.

    ``tier_names``: the stack's tiers in order, the first tier's name first (per-tier
    counters are ``<name>.miss_<cause>``).
    """

    def __init__(self, keys: int, tier_names: Sequence[str], *, tag_bits: int = _TAG_BITS):
        if len(tier_names) > MAX_TIERS:
            raise ValueError(
                f"miss causes name up to {MAX_TIERS} tiers, the stack has {len(tier_names)}: "
                "set miss_causes: off"
            )
        self.sketch = CauseSketch(keys, tag_bits=tag_bits)
        self.tier_names = list(tier_names)
        self.counts = dict.fromkeys(CAUSES, 0)
        self.foreign = dict.fromkeys(FOREIGN_PARTS, 0)
        # per tier: every cause but new (nothing is new because of a tier)
        self.per_tier = [dict.fromkeys(CAUSES[1:], 0) for _ in tier_names]

    def count(self, cause: str, tier: int | None = None, part: str | None = None, n: int = 1) -> None:
        """Count ``n`` misses of ``cause``, attributed to tier index ``tier`` (None: no tier)."""
        self.counts[cause] += n
        if tier is not None and cause != "new":
            self.per_tier[tier][cause] += n
        if part is not None:
            self.foreign[part] = self.foreign.get(part, 0) + n

    def recorded(self, key: OffloadKey) -> tuple[str, int | None, str | None]:
        """What the sketch says of a key no tier holds: ``(cause, tier index, foreign part)``."""
        record = self.sketch.get(key)
        event = record >> 5
        if not event:
            return "new", None, None
        if event == FOREIGN:
            index = record & 31
            return "foreign", None, FOREIGN_PARTS[index] if index < len(FOREIGN_PARTS) else "layout"
        return _CAUSE_OF[event], record & 31, None

    def stored_at(self, key: OffloadKey) -> int | None:
        """The tier index the sketch last saw store ``key`` below, or None."""
        record = self.sketch.get(key)
        return record & 31 if record >> 5 == STORED else None

    def store_failed(self, failed: dict[OffloadKey, Failure], tier: int) -> None:
        """Remember the keys a store job of tier ``tier`` could not save, and why."""
        put = self.sketch.put
        for key, reason in failed.items():
            put((key,), _store_record(reason), tier)

    def read_failed(self, failed: dict[OffloadKey, Failure], tier: int) -> None:
        """Count each key a read from tier ``tier`` could not bring up as a miss, and
        remember why (a later lookup of it, with no tier holding it, says the same)."""
        put = self.sketch.put
        for key, reason in failed.items():
            cause, part = failure_cause(reason)
            if part is not None:
                put((key,), FOREIGN, FOREIGN_PARTS.index(part))
                self.count(cause, tier, part)
                continue
            put((key,), _READ_RECORD[cause], tier)
            self.count(cause, tier)

    def remember_foreign(self, keys: Iterable[OffloadKey], part: str) -> None:
        """``keys`` were held under an identity differing in ``part`` and are gone (a disk
        store wiped for another layout, a sibling's namespace): their misses are ``foreign``,
        not ``new``."""
        self.sketch.put(keys, FOREIGN, FOREIGN_PARTS.index(part) if part in FOREIGN_PARTS else 0)

    def found_foreign(self, key: OffloadKey, part: str, tier: int) -> None:
        """A probe found ``key``, counted as a ``new`` miss, under a sibling of tier ``tier``
        that differs in ``part``: the miss moves from new to foreign, and later misses of
        the key are foreign at once."""
        if self.counts["new"]:
            self.counts["new"] -= 1
            self.count("foreign", tier, part)
        self.remember_foreign((key,), part)

    def stats(self) -> dict[str, float]:
        """``miss_<cause>``, ``foreign_<part>``, per tier ``<tier>.miss_<cause>``, and the
        sketch's size and stated error rate."""
        sketch = self.sketch
        figures: dict[str, float] = {f"miss_{cause}": n for cause, n in self.counts.items()}
        figures.update({f"foreign_{part}": n for part, n in self.foreign.items()})
        for name, counts in zip(self.tier_names, self.per_tier):
            figures.update({f"{name}.miss_{cause}": n for cause, n in counts.items()})
        figures.update(
            sketch_bytes=sketch.nbytes,
            sketch_keys=sketch.keys,
            sketch_error_rate=sketch.error_rate,
            sketch_forgotten=sketch.forgotten,
        )
        return figures

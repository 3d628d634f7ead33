"""Why a lookup missed: a bounded sketch of what each key went through, and the cause counters.

:class:`CauseSketch` remembers, for up to ``keys`` offload keys, the last thing that happened
to each (stored below, evicted by a tier, refused by a tier's admission, a store that failed,
a read that failed verification, a tier that could not be reached), in about 5.3 bytes a
key: a table of 4-way buckets (a quarter more slots than ``keys``), each key in the emptier
of two, each slot 32 bits (a 24-bit tag of the key and one byte of event and tier), plus a
one-byte replacement cursor per bucket. A key it never saw matches a remembered tag with
probability at most ``1 - (1 - 2**-24)**8`` (4.8e-7, :attr:`CauseSketch.error_rate`); a key that
finds both its buckets full replaces an entry of the first in turn (round robin: roughly the
oldest; ``forgotten``), which then reads as never seen. It reads and writes whole batches of
keys with numpy, and reads them in C where :mod:`kvtier._speedups` was built. Why this table
and not a Bloom or cuckoo filter: docs/design/miss-causes.md.

:class:`MissCauses` is what a manager holds: the sketch, the counters ``stats()`` shows
(``miss_<cause>``, ``<tier>.miss_<cause>``, ``foreign_<part>``), and a log between them. A
lookup that misses appends its key to the log (:attr:`MissCauses.missed`, one C call) and
a tier's news appends its keys (:meth:`MissCauses.remember`); the log goes through the sketch
in order, a batch at a time, once :data:`FLUSH_KEYS` keys wait at a step's end, and whenever
the counters are read. Every lookup answered ``False`` for want of the block, and every read
from below that failed, is counted under exactly one of :data:`CAUSES`.

Threading: the engine's scheduler thread, like the managers that hold it; the counters may
also be read from another thread (a metrics scrape): the log is applied under a lock, which
the appends of the scheduler's hot path never take.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import threading
import types
from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.base import OffloadKey
from kvtier.tiers.jobs import Failure, FailureKind

speedups: types.ModuleType | None
try:  # the hot path in C, built with the package where a C compiler was (src/kvtier/_speedups.c)
    import kvtier._speedups as speedups
except ImportError:  # none: the same logic in Python and numpy
    speedups = None

__all__ = [
    "CAUSES",
    "FLUSH_KEYS",
    "FOREIGN_PARTS",
    "CauseSketch",
    "MissCauses",
    "failure_cause",
    "stack_keys",
]

#: every cause a miss is counted under (stats ``miss_<cause>``); ``behind``: a block after the
#: request's first miss that a tier held (only an engine that reports them counts it: a replay)
CAUSES = (
    "new",
    "evicted",
    "refused",
    "store_failed",
    "corrupt",
    "unavailable",
    "filtered",
    "foreign",
    "behind",
)
#: the parts of a block's identity a ``foreign`` miss can name (stats ``foreign_<part>``)
FOREIGN_PARTS = ("layout", "tp", "namespace", "secret", "codec")
#: keys waiting in the log that make the step's end apply it (bounds the log's memory)
FLUSH_KEYS = 4096
#: the bounds of a sketch sized from the stack (:func:`stack_keys`): 21 KB to 22 MB
MIN_STACK_KEYS, MAX_STACK_KEYS = 1 << 12, 1 << 22

# What the sketch remembers of a key (the high 3 bits of its byte; the low 5 bits hold the
# tier's index in the stack, 0 the first tier, or for FOREIGN the part's index).
STORED = 1  # a tier below the first holds it (the tier that stored it last)
EVICTED = 2  # the tier that let it go last
REFUSED = 3  # a tier's admission would not take it
FAILED = 4  # a tier could not take it (full, ENOSPC, EIO ...)
CORRUPT = 5  # found, but failed verification when read
UNAVAILABLE = 6  # the tier could not be reached when it was stored or read
FOREIGN = 7  # found under another layout or secret (the part in the low bits)
# REFUSED and every event after it say why the block is not below
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
_TAG_BITS = 24  # a slot is one 32-bit word: the tag above the record byte
_GOLDEN = np.uint32(0x9E3779B1)  # spreads a tag over the offset of the second bucket
_U64_1, _U64_32, _U64_56, _U64_255 = np.uint64(1), np.uint64(32), np.uint64(56), np.uint64(255)
_BYTES_SUM = np.uint64(0x0101010101010101)
#: keys a probe of the sketch reads at once: its largest temporary (both buckets of each key)
#: is then 256 KB, in the CPU's cache; at 16,384 keys glibc gives the 512 KB temporaries back
#: to the kernel after each batch and the next one page-faults them in (34 ns a key, not 13)
_PROBE_KEYS = 1 << 13


def stack_keys(cpu_blocks: int, lower_blocks: int) -> int:
    """How many keys a stack's sketch remembers unless configured: what its CPU tier holds,
    plus twice what its lower tiers hold, within :data:`MIN_STACK_KEYS` and
    :data:`MAX_STACK_KEYS`.

    A block in the CPU tier needs no record while it is there, so a CPU tier alone remembers
    as many blocks gone as it holds (ARC's ghost lists hold as many). A lower tier's block
    has one the whole time it is held (``stored``), and as much room again keeps the blocks
    it let go.
    """
    return max(MIN_STACK_KEYS, min(MAX_STACK_KEYS, cpu_blocks + 2 * lower_blocks))


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


def _merged(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The records after the events ``new`` happened to keys whose records are ``old`` (one
    pair per key; record bytes).

    * a tier's eviction keeps a record that says why the block is not below (refused, failed,
      corrupt, unreachable, foreign: taking it would have kept it), and a record that another
      tier holds it; else the evicting tier is the last holder;
    * a refusal or failure keeps a record that another tier holds it;
    * a store, a corrupt read, an unreachable tier: always the newest news.
    """
    old_event, event = old >> 5, new >> 5
    elsewhere = (old_event == STORED) & ((old & 31) != (new & 31))
    keep = ((event == EVICTED) & ((old_event >= REFUSED) | elsewhere)) | (
        ((event == REFUSED) | (event == FAILED)) & elsewhere
    )
    return np.where(keep, old, new)


class CauseSketch:
    """A fixed table remembering one record byte for each of up to ``keys`` keys.

    Keys are placed by :func:`key_hashes` (keyed, a batch at a time): the top ``tag_bits`` bits
    of one half are the tag, the other half picks the first bucket, and the tag the offset of the
    second.

    ``tag_bits`` (at most 24) trades memory-free accuracy for testing: with fewer bits the
    false-match rate is large enough to measure (tests/manager/test_causes.py).
    """

    def __init__(self, keys: int, *, tag_bits: int = _TAG_BITS):
        if keys < _WAYS:
            raise ValueError(f"a cause sketch remembers at least {_WAYS} keys, got {keys}")
        if not 1 <= tag_bits <= _TAG_BITS:
            raise ValueError(f"tag_bits must be 1 to {_TAG_BITS}, got {tag_bits}")
        self._keys = keys
        # a quarter more slots than keys: two-choice buckets of 4 then forget ~1.4% of the
        # keys at `keys` held (at 100% load they would forget 8%)
        self._buckets = -(-(keys * 5 // 4) // _WAYS)
        self._slots = np.zeros(_WAYS * self._buckets, dtype=np.uint32)
        self._table = self._slots.reshape(self._buckets, _WAYS)  # a view: a bucket a row
        self._cursor = np.zeros(self._buckets, dtype=np.uint8)
        self._shift = np.uint32(32 - tag_bits)
        self._buckets_u64 = np.uint64(self._buckets)
        self._moves = np.uint64(self._buckets - 1)  # how far the second bucket may be from the first
        self.tag_bits = tag_bits
        #: records overwritten to make room for another key (that key now reads as never seen)
        self.forgotten = 0

    @property
    def keys(self) -> int:
        """How many keys it is sized to remember at once."""
        return self._keys

    @property
    def nbytes(self) -> int:
        """Bytes its tables hold (the slots, the cursors)."""
        return self._slots.nbytes + self._cursor.nbytes

    @property
    def error_rate(self) -> float:
        """The most likely a key it never saw is taken for one it did: a tag match in one of
        the 8 slots of its two buckets, ``1 - (1 - q)**8``. With ``n = 2**tag_bits`` tags, a
        tag of 0 is taken as 1 (0 marks an empty slot), so tag 1 is twice as likely as the
        others and two random tags match with ``q = (n + 2) / n**2``, not ``1 / n``."""
        tags = 2.0**self.tag_bits
        return 1.0 - (1.0 - (tags + 2.0) / tags**2) ** (2 * _WAYS)

    def _place(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per key hash: its non-zero tag (the top bits of one half of the hash), its first
        bucket (the other half, scaled to the table: a multiply and a shift, no division)
        and its second (the first, moved on by an amount the tag decides, never 0)."""
        halves = hashes.view(np.uint32)
        tags = halves[1::2] >> self._shift
        tags |= tags == 0  # 0 marks an empty slot
        buckets = self._buckets_u64
        first = (halves[0::2].astype(np.uint64) * buckets) >> _U64_32
        second = first + ((((tags * _GOLDEN).astype(np.uint64) * self._moves) >> _U64_32) + _U64_1)
        second -= (second >= buckets) * buckets
        return tags, first.astype(np.intp), second.astype(np.intp)

    def records(self, keys: Sequence[OffloadKey], start: int = 0, stop: int | None = None) -> np.ndarray:
        """Each record byte (event << 5 | tier) of ``keys[start:stop]``, 0 where it is not
        remembered. With :mod:`kvtier._speedups`, hashed and probed in C in one pass (the same
        answers: tests/manager/test_causes.py), at most :data:`_PROBE_KEYS` keys a call."""
        stop = len(keys) if stop is None else stop
        if speedups is None or stop - start > _PROBE_KEYS:
            return self.records_at(key_hashes(keys[start:stop]))
        listed = keys if type(keys) is list else list(keys)
        raw, left = speedups.probe(
            listed, start, stop, _MULTIPLIER_BYTES, self._slots, int(self._shift), int(self._moves)
        )
        found = np.frombuffer(raw, dtype=np.uint8)
        if left:  # keys C does not hash (not bytes, or long): their hash here, probed in numpy
            found = found.copy()
            hashes = np.array([_one_hash(listed[start + index]) for index in left], dtype=np.uint64)
            found[left] = self.words_at(hashes)
        return found

    def records_at(self, hashes: np.ndarray) -> np.ndarray:
        """:meth:`records` of the keys whose :func:`key_hashes` are ``hashes``."""
        found = np.empty(hashes.size, dtype=np.uint8)
        # in batches whose temporaries stay in the CPU's cache, and large enough that each
        # numpy call's own cost is spread thin (:data:`_PROBE_KEYS`)
        for first in range(0, hashes.size, _PROBE_KEYS):
            found[first : first + _PROBE_KEYS] = self.words_at(hashes[first : first + _PROBE_KEYS])
        return found

    def words_at(self, hashes: np.ndarray) -> np.ndarray:
        """Each key's record as a 64-bit word (its value below 256), for a batch of at most
        :data:`_PROBE_KEYS` hashes: what :meth:`records_at` narrows to bytes."""
        tags, first, second = self._place(hashes)
        # both buckets of a key side by side: eight 32-bit slots a row, the first bucket's first
        rows = np.take(self._table, np.stack((first, second), axis=1), axis=0).reshape(-1, 2 * _WAYS)
        # each slot's record byte, read as one little-endian 64-bit word a key: slot i is byte i
        found = rows.astype(np.uint8).view("<u8").ravel()
        # one byte a slot, 1 where the tag matches, read the same way
        rows >>= np.uint32(8)
        match = (rows == tags[:, None]).view("<u8").ravel()
        # the first matching slot's byte, 1 << 8 * slot (0 if none), made 0xFF: its record's mask
        lowest = ~match
        lowest += _U64_1
        lowest &= match
        lowest *= _U64_255
        found &= lowest
        # one byte left: a multiply sums every byte into the top one (no carries), a shift brings it down
        found *= _BYTES_SUM
        found >>= _U64_56
        return found

    def get(self, key: OffloadKey) -> int:
        """The key's record byte (event << 5 | tier), or 0 if not remembered."""
        return int(self.records((key,))[0])

    def put(self, keys: Sequence[OffloadKey], event: int, tier: int) -> None:
        """Remember ``event`` at ``tier`` for each of ``keys``, by the rules of
        :func:`_merged` (a later event replaces an earlier one, except where the earlier
        one still explains why the block is not below)."""
        self.put_records(keys, np.full(len(keys), event << 5 | tier, dtype=np.uint8))

    def put_records(self, keys: Sequence[OffloadKey], new: np.ndarray) -> None:
        """Remember record ``new[i]`` for ``keys[i]``, in order (a key named twice gets the
        second on top of the first)."""
        self.put_at(key_hashes(keys), new)

    def put_at(self, hashes: np.ndarray, new: np.ndarray) -> None:
        """:meth:`put_records` of the keys whose :func:`key_hashes` are ``hashes``,
        :data:`FLUSH_KEYS` keys at a time (a larger batch would choose buckets on older news
        of what they hold, and forget more)."""
        for first in range(0, hashes.size, FLUSH_KEYS):
            self._put_batch(hashes[first : first + FLUSH_KEYS], new[first : first + FLUSH_KEYS])

    def _put_batch(self, hashes: np.ndarray, new: np.ndarray) -> None:
        """:meth:`put_at` of one batch, in rounds: each round, every key still to place is
        looked up; of the keys that would touch the same slot (a found key's, the cursor slot
        of a full bucket) or take an empty slot of the same bucket, only the first goes, and
        the rest wait for the next round, which sees what it did. In a table far larger than
        the batch, one round places nearly every key."""
        if not hashes.size:
            return
        tags, first, second = self._place(hashes)
        slots, table, cursor = self._slots, self._table, self._cursor
        waiting = np.arange(len(tags))
        while waiting.size:
            tag, one_at, two_at = tags[waiting], first[waiting], second[waiting]
            one, two = np.take(table, one_at, axis=0), np.take(table, two_at, axis=0)
            in_one, in_two = _lanes((one >> 8) == tag[:, None]), _lanes((two >> 8) == tag[:, None])
            hit_one = in_one != 0
            found = hit_one | (in_two != 0)
            slot = np.where(hit_one, one_at * _WAYS + _LOWEST[in_one], two_at * _WAYS + _LOWEST[in_two])
            # a new key: the emptier bucket (the first on a tie); both full: the first's cursor slot
            free_one, free_two = _lanes(one == 0), _lanes(two == 0)
            use_one = _COUNT[free_one] >= _COUNT[free_two]
            bucket = np.where(use_one, one_at, two_at)
            free = np.where(use_one, free_one, free_two)
            full = free == 0
            target = bucket * _WAYS + np.where(full, cursor[bucket], _LOWEST[free])
            # what two keys of one round must not both touch: a slot, or a bucket's empty slots
            claim = np.where(found, slot, np.where(full, target, slots.size + bucket))
            order = np.argsort(claim, kind="stable")
            ranked = claim[order]
            firsts = np.ones(ranked.size, dtype=bool)
            firsts[1:] = ranked[1:] != ranked[:-1]
            going = order[firsts]  # each claim's first key
            merge = going[found[going]]
            if merge.size:
                at = slot[merge]
                old = slots[at]
                merged = _merged((old & 0xFF).astype(np.uint8), new[waiting[merge]])
                slots[at] = (old & np.uint32(0xFFFFFF00)) | merged
            place = going[~found[going]]
            if place.size:
                slots[target[place]] = (tag[place] << np.uint32(8)) | new[waiting[place]]
                evict = place[full[place]]
                if evict.size:  # distinct buckets (their claims are distinct slots of them)
                    cursor[bucket[evict]] = (cursor[bucket[evict]] + 1) % _WAYS
                    self.forgotten += int(evict.size)
            if going.size == waiting.size:
                return
            later = np.ones(waiting.size, dtype=bool)
            later[going] = False
            waiting = waiting[later]


#: the bytes a key is packed into to be hashed: its length (one byte), then its first 47
#: bytes, zero-padded (vLLM's keys are 36: a 32-byte block hash and a 4-byte group; SGLang's 32)
_ROW_BYTES = 48
_WORDS = _ROW_BYTES // 8
#: a row's length byte from here on: the words do not hold the whole key (or it is not bytes)
_LONG = _ROW_BYTES - 1
#: this process's random odd multipliers, one a word, and the key of the long keys' hash: the
#: hash is keyed, as Python's own is (nobody outside the process can choose keys that collide)
_SECRET = os.urandom(8 * _WORDS + 16)
_MULTIPLIERS = [np.uint64(int(m) | 1) for m in np.frombuffer(_SECRET[: 8 * _WORDS], dtype=np.uint64)]
_MULTIPLIER_BYTES = np.array(_MULTIPLIERS, dtype=np.uint64).tobytes()  # for the C hash
_U64_29 = np.uint64(29)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)


@functools.lru_cache(maxsize=4)
def _packer(count: int) -> struct.Struct:
    """Packs ``count`` bytes keys, each as a row of :data:`_ROW_BYTES`: a Pascal string (its
    length, capped at :data:`_LONG`, then its bytes, cut or padded with zeros). A packer
    holds about 35 bytes a key (287 KB at a probe's 8,192) and takes 5 ns a key to build: the
    few last sizes are kept (a full probe batch, a full flush), the rest built when asked."""
    return struct.Struct(f"{_ROW_BYTES}p" * count)


def _row(key: object) -> bytes:
    """One key's row; a key that is not bytes gets a length byte of 255 (none packed has it)."""
    if isinstance(key, bytes):
        return _packer(1).pack(key)
    return b"\xff" * _ROW_BYTES


def _one_hash(key: object) -> int:
    """The hash of a key its row does not hold (longer than :data:`_LONG` bytes, or not bytes)."""
    if isinstance(key, bytes):
        digest = hashlib.blake2b(key, digest_size=8, key=_SECRET[8 * _WORDS :]).digest()
        return int.from_bytes(digest, "little")
    return hash(key) & 0xFFFFFFFFFFFFFFFF


def key_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """A keyed 64-bit hash of each key (uint64): what places a key in the sketch.

    Each key is a row of :data:`_ROW_BYTES`: its length and bytes. The rows are mixed a word
    at a time (xor in a word, multiply by an odd number, xor-shift: each step a bijection of
    the state, so two rows that differ in one word never collide). A key of :data:`_LONG`
    bytes or more, or not bytes, is hashed alone (BLAKE2b), so every key is told apart by all
    of it. With :mod:`kvtier._speedups` the rows are mixed in C, a key at a time; else
    :func:`numpy_key_hashes` does it over the whole batch; both give the same hashes."""
    if speedups is None:
        return numpy_key_hashes(keys)
    raw, left = speedups.key_hashes(keys if type(keys) is list else list(keys), _MULTIPLIER_BYTES)
    hashes = np.frombuffer(raw, dtype=np.uint64)
    for index in left:
        hashes[index] = _one_hash(keys[index])
    return hashes


def numpy_key_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """:func:`key_hashes` without C: the keys packed in one call, the rows mixed with numpy."""
    try:
        packed = _packer(len(keys)).pack(*keys)
    except struct.error:  # a key that is not bytes
        packed = b"".join(map(_row, keys))
    rows = np.frombuffer(packed, dtype=np.uint64).reshape(len(keys), _WORDS)
    hashes = rows[:, 0] * _MULTIPLIERS[0]
    hashes ^= hashes >> _U64_29
    for column in range(1, _WORDS):
        hashes ^= rows[:, column]
        hashes *= _MULTIPLIERS[column]
        hashes ^= hashes >> _U64_29
    hashes *= _FINAL
    hashes ^= hashes >> _U64_32
    for index in np.flatnonzero(np.frombuffer(packed, dtype=np.uint8)[::_ROW_BYTES] >= _LONG).tolist():
        hashes[index] = _one_hash(keys[index])
    return hashes


def _lanes(mask: np.ndarray) -> np.ndarray:
    """Per row of a C-ordered ``(n, 4)`` bool array, its lanes as a 4-bit number (lane 0 the
    lowest bit): one 32-bit word a row, so no reduction along the short axis, which numpy runs
    slowly."""
    word = mask.view("<u4").ravel()
    return (word | word >> 7 | word >> 14 | word >> 21) & 15


#: per 4-bit lane pattern: its lowest set lane (0 where none), and how many are set
_LOWEST = np.array([0, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0], dtype=np.intp)
_COUNT = np.array([bin(pattern).count("1") for pattern in range(16)], dtype=np.uint8)


class MissCauses:
    """The miss-cause counters of one manager, its :class:`CauseSketch` and the log between.

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
        #: keys that missed, in order, their causes not decided yet: a miss the sketch decides
        #: is ``missed.append(key)`` (no lock, no count yet; the lookup's fast path, where
        #: CPython runs a list's ``append`` called so without a call); only :meth:`flush`
        #: takes keys out, and only at the front
        self.missed: list[OffloadKey] = []
        #: misses decided since creation (the position of ``missed[0]`` in the whole sequence)
        self._decided = 0
        #: news for the sketch, in order: (keys, record, misses noted before it)
        self._news: list[tuple[Sequence[OffloadKey], int, int]] = []
        self._news_keys = 0
        #: whether to keep the keys decided ``new`` for :meth:`take_new` (a stack that probes)
        self.collect_new = False
        self._new: list[OffloadKey] = []
        self._lock = threading.Lock()

    # -- the scheduler's side ----------------------------------------------------------------

    def remember(self, keys: Iterable[OffloadKey], event: int, tier: int) -> None:
        """``event`` happened at tier index ``tier`` to each of ``keys`` (logged; the sketch
        takes it in order with the misses)."""
        keys = tuple(keys)  # the caller's list may change (an engine owns evicted_keys)
        if not keys:
            return
        with self._lock:
            self._news.append((keys, event << 5 | tier, self._decided + len(self.missed)))
            self._news_keys += len(keys)
        if self._news_keys >= 4 * FLUSH_KEYS:  # a burst with no step's end in between
            self.flush()

    def step_end(self) -> None:
        """A step ended: apply the log once :data:`FLUSH_KEYS` keys wait in it."""
        if len(self.missed) + self._news_keys >= FLUSH_KEYS:
            self.flush()

    def count(self, cause: str, tier: int | None = None, part: str | None = None, n: int = 1) -> None:
        """Count ``n`` misses of ``cause``, attributed to tier index ``tier`` (None: no tier)."""
        with self._lock:
            self._count(cause, tier, part, n)

    def _count(self, cause: str, tier: int | None, part: str | None, n: int) -> None:
        self.counts[cause] += n
        if tier is not None and cause != "new":
            self.per_tier[tier][cause] += n
        if part is not None:
            self.foreign[part] = self.foreign.get(part, 0) + n

    def stored_at(self, key: OffloadKey) -> int | None:
        """The tier index the sketch last saw store ``key`` below, or None."""
        record = int(self.records_now((key,))[0])
        return record & 31 if record >> 5 == STORED else None

    def records_now(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """What the sketch remembers of each of ``keys``, the log applied first."""
        self.flush()
        with self._lock:
            return self.sketch.records(keys)

    def store_failed(self, failed: dict[OffloadKey, Failure], tier: int) -> None:
        """Remember the keys a store job of tier ``tier`` could not save, and why."""
        for key, reason in failed.items():
            self.remember((key,), _store_record(reason), tier)

    def read_failed(self, failed: dict[OffloadKey, Failure], tier: int) -> None:
        """Count each key a read from tier ``tier`` could not bring up as a miss, and
        remember why (a later lookup of it, with no tier holding it, says the same)."""
        for key, reason in failed.items():
            cause, part = failure_cause(reason)
            if part is not None:
                self.remember((key,), FOREIGN, FOREIGN_PARTS.index(part))
            else:
                self.remember((key,), _READ_RECORD[cause], tier)
            self.count(cause, tier, part)

    def remember_foreign(self, keys: Iterable[OffloadKey], part: str) -> None:
        """``keys`` were held under an identity differing in ``part`` and are gone (a disk
        store wiped for another layout, a sibling's namespace): their misses are ``foreign``,
        not ``new``."""
        self.remember(keys, FOREIGN, FOREIGN_PARTS.index(part) if part in FOREIGN_PARTS else 0)

    def found_foreign(self, key: OffloadKey, part: str, tier: int) -> None:
        """A probe found ``key``, counted as a ``new`` miss, under a sibling of tier ``tier``
        that differs in ``part``: the miss moves from new to foreign, and later misses of
        the key are foreign at once."""
        with self._lock:
            if self.counts["new"]:
                self.counts["new"] -= 1
                self._count("foreign", tier, part, 1)
        self.remember_foreign((key,), part)

    def take_new(self) -> list[OffloadKey]:
        """The keys decided ``new`` since the last call (with :attr:`collect_new`); the log is
        applied first."""
        self.flush()
        with self._lock:
            new, self._new = self._new, []
        return new

    # -- applying the log --------------------------------------------------------------------

    def flush(self) -> None:
        """Put the logged news through the sketch and decide the logged misses, in their order."""
        if not self.missed and not self._news:
            return
        with self._lock:
            missed = self.missed
            noted = len(missed)  # misses appended from here on wait for the next flush
            news, self._news, self._news_keys = self._news, [], 0
            decided = self._decided
            done = 0
            batch: list[OffloadKey] = []
            records: list[tuple[int, int]] = []
            for told, record, before in news:
                if before - decided > done:  # misses came between: the news so far first
                    self._apply(batch, records)
                    batch, records = [], []
                    self._decide(done, before - decided)
                    done = before - decided
                batch.extend(told)
                records.append((record, len(told)))
            self._apply(batch, records)
            if noted > done:
                self._decide(done, noted)
            del missed[:noted]
            self._decided = decided + noted

    def _apply(self, keys: list[OffloadKey], records: list[tuple[int, int]]) -> None:
        if keys:
            values, lengths = zip(*records)
            self.sketch.put_records(keys, np.repeat(np.array(values, dtype=np.uint8), lengths))

    def _decide(self, start: int, stop: int) -> None:
        """Count each of the logged misses ``missed[start:stop]`` (misses no tier could
        explain) under what the sketch says: a probe's batch of keys at a time, each batch's
        records counted as they come (no array of their records)."""
        missed, sketch = self.missed, self.sketch
        seen = np.zeros(256, dtype=np.intp)
        for first in range(start, stop, _PROBE_KEYS):
            found = sketch.records(missed, first, min(first + _PROBE_KEYS, stop))
            seen += np.bincount(found, minlength=256)
            if self.collect_new:
                self._new.extend(missed[first + i] for i in np.flatnonzero(found == 0).tolist())
        for record in np.flatnonzero(seen).tolist():
            n = int(seen[record])
            event = record >> 5
            if not event:
                self._count("new", None, None, n)
            elif event == FOREIGN:
                index = record & 31
                self._count(
                    "foreign", None, FOREIGN_PARTS[index] if index < len(FOREIGN_PARTS) else "layout", n
                )
            else:
                self._count(_CAUSE_OF[event], record & 31, None, n)

    # -- reading -----------------------------------------------------------------------------

    @property
    def misses(self) -> int:
        """Misses counted so far (the log applied first)."""
        self.flush()
        return sum(self.counts.values())

    def totals(self) -> dict[str, int]:
        """``miss_<cause>`` counts by cause, the log applied first."""
        self.flush()
        return dict(self.counts)

    def stats(self) -> dict[str, float]:
        """``miss_<cause>``, ``foreign_<part>``, per tier ``<tier>.miss_<cause>``, and the
        sketch's size and stated error rate (the log applied first)."""
        self.flush()
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

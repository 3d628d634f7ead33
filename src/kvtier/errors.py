"""The one exception tree of kvtier.

Expected outcomes (a miss, a full tier, a retry) are return values, never exceptions: see
``OffloadingManager.lookup`` and ``prepare_store``, and the per-key
:class:`~kvtier.tiers.base.Failure` of a lower tier's job. (So there is no "tier full" error:
nothing could raise it where a full tier is an outcome.) What raises is a mistake — bad input or a
broken environment — and every error carries the context needed to fix it.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "BlockStateError",
    "ConfigError",
    "DiskTierError",
    "IndexDamagedError",
    "KvtierError",
    "ManifestError",
    "TraceError",
    "ValkeyCheckError",
    "shown_value",
]

#: the longest text :func:`shown_value` gives for one value
SHOWN_VALUE_CHARS = 200


class _ShortRepr(reprlib.Repr):
    """``repr`` that stops early: a value's first elements, a string's two ends."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 16
        self.maxset = self.maxfrozenset = self.maxdeque = 16
        self.maxstring = self.maxother = SHOWN_VALUE_CHARS
        self.maxlong = 60


_SHORT_REPR = _ShortRepr()


def shown_value(value: object) -> str:
    """``repr(value)`` for an error message, at most :data:`SHOWN_VALUE_CHARS` long.

    Bounded work too, not only bounded text: a value from a YAML file of nested aliases
    expands to billions of elements, and the full repr (then cut) took gigabytes.
    """
    try:
        text = _SHORT_REPR.repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit for str()
        text = f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    if len(text) > SHOWN_VALUE_CHARS:
        half = SHOWN_VALUE_CHARS // 2 - 2
        text = f"{text[:half]}...{text[-half:]}"
    return text


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is wrong.

    The message names the field path (``tiers[1].capacity``), the value found, what would be
    valid and how to fix it, so that a user can act on it without reading kvtier's code.
    """

    def __init__(self, field: str, value: object, expected: str, fix: str | None = None):
        self.field = field
        self.value = value
        self.expected = expected
        self.fix = fix
        message = f"{field}: got {shown_value(value)}; expected {expected}"
        if fix:
            message += f". Fix: {fix}"
        super().__init__(message)


class TraceError(KvtierError):
    """A request trace cannot be read: the message names the file, the line and the field."""


class BlockStateError(KvtierError):
    """A manager call named a block in a state the call does not allow.

    For example ``prepare_load`` of a key that is not ready, or ``complete_load`` of a key
    that was never prepared: the caller broke the protocol, and going on would risk serving
    or overwriting the wrong bytes.
    """


class DiskTierError(KvtierError):
    """A disk tier cannot be used as asked for a reason that is not one configuration value
    (for example its path is already open as a tier in this process)."""


class IndexDamagedError(DiskTierError):
    """A disk tier's on-disk index is damaged (a truncated or garbled LMDB file, say): found
    before it is used, and named with the fix (``kvtier check PATH --fix``)."""


class ManifestError(KvtierError):
    """A store manifest exists but cannot be read or understood (damaged, or from a newer kvtier)."""


class ValkeyCheckError(KvtierError):
    """``kvtier check`` of a Valkey store could not run: the server could not be reached, or
    answered with an error.

    ``target`` is the URL (or cluster nodes) as given; the message says what failed and how to
    fix it.
    """

    def __init__(self, target: str, problem: str, fix: str):
        self.target = target
        self.problem = problem
        self.fix = fix
        super().__init__(f"{target}: {problem}. Fix: {fix}")

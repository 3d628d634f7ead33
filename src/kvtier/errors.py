"""The one exception tree of kvtier.

Expected outcomes (a miss, a full tier, a retry) are return values, never exceptions: see
``OffloadingManager.lookup`` and ``prepare_store``. What raises is a mistake — bad input or a
broken environment — and every error carries the context needed to fix it.
"""

from __future__ import annotations

__all__ = ["KvtierError", "ConfigError", "TierFullError", "BlockStateError"]


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
        message = f"{field}: got {value!r}; expected {expected}"
        if fix:
            message += f". Fix: {fix}"
        super().__init__(message)


class TierFullError(KvtierError):
    """A tier cannot hold what was asked of it, even after evicting everything evictable."""

    def __init__(self, tier: str, capacity_bytes: int, used_bytes: int, requested_bytes: int):
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.used_bytes = used_bytes
        self.requested_bytes = requested_bytes
        super().__init__(
            f"tier {tier!r} is full: capacity {capacity_bytes} B, used {used_bytes} B, "
            f"requested {requested_bytes} B"
        )


class BlockStateError(KvtierError):
    """A manager call named a block in a state the call does not allow.

    For example ``prepare_load`` of a key that is not ready, or ``complete_load`` of a key
    that was never prepared: the caller broke the protocol, and going on would risk serving
    or overwriting the wrong bytes.
    """

"""The shared tier on a Valkey (or Redis) server or cluster: ``kind: valkey`` (or ``redis``).

- :mod:`~kvtier.tiers.valkey.config`: the section's frozen dataclass and its parser;
- :mod:`~kvtier.tiers.valkey.tier`: :class:`ValkeyTier`, the :class:`~kvtier.tiers.base.SecondaryTier`;
- :mod:`~kvtier.tiers.valkey.connection`: pipelined batches against a server or a cluster;
- :mod:`~kvtier.tiers.valkey.check`: ``kvtier check valkey://...``, the values verified per namespace;
- :mod:`~kvtier.tiers.valkey.server`: loopback servers for tests, benchmarks and fleet replays.

Importing this package does not import the ``valkey`` client: the tier does, when opened.
"""

from __future__ import annotations

from kvtier.tiers.valkey.config import PASSWORD_ENV, VALKEY_KINDS, ValkeyTierConfig, parse, redact_url

__all__ = ["PASSWORD_ENV", "VALKEY_KINDS", "ValkeyTierConfig", "open_valkey", "parse", "redact_url"]


def open_valkey(config: ValkeyTierConfig, rows, fingerprint, field: str = "tiers[1]"):
    """Open the valkey tier ``config`` describes over CPU rows ``rows`` (see ``ValkeyTier.open``)."""
    return config.open_lower(rows, fingerprint, field=field)

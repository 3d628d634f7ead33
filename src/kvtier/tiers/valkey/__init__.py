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
    import importlib.util

    if importlib.util.find_spec("valkey") is None:  # the client the tier needs
        from kvtier.errors import ConfigError

        raise ConfigError(
            f"{field}.kind", config.kind, "a tier whose client is installed",
            "pip install 'kvtier[valkey]' (the valkey client and its libvalkey parser)",
        )
    from kvtier.tiers.valkey.tier import ValkeyTier

    return ValkeyTier.open(config, rows, fingerprint, field=field)

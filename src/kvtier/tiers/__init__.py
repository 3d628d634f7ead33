"""Tiers: where offloaded blocks live, one package or module per kind.

- ``base``: the lower-tier (secondary-tier) contract every tier below the CPU tier keeps, its
  job types and failure reasons, and ``IndexedTier``, the scheduler-side bookkeeping every
  lower tier shares;
- ``cpu/``: the first tier (a ``Backend``): a shared-memory region, its slot allocator;
- ``disk/``: the local disk tiers (``lmdb``, ``files``), their block format and I/O;
- ``memory``: the in-memory tiers: test doubles and the template for a new tier.

Each kind's configuration section sits beside its tier (``cpu/config.py``,
``disk/config.py``) and is registered once, in :data:`kvtier.config.TIER_KINDS`; a kind from
outside kvtier is named by class path instead. Nothing is imported here, so the scheduler
side does not pay for tiers it does not use.
"""

__all__: list[str] = []

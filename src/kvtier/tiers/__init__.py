"""Tiers: where offloaded blocks live, one package or module per kind.

- ``base``: the lower-tier (secondary-tier) contract every tier below the CPU tier keeps, and
  its job types;
- ``cpu/``: the first tier (a ``Backend``): a shared-memory region, its slot allocator;
- ``disk/``: the local disk tiers (``lmdb``, ``files``), their block format and I/O;
- ``memory``: the in-memory tiers: test doubles and the template for a new tier.

Nothing is imported here, so the scheduler side does not pay for tiers it does not use.
"""

__all__: list[str] = []

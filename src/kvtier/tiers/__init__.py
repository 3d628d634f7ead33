"""Tiers: where offloaded blocks live, one file per medium.

``shm`` holds the shared-memory region the CPU tier is made of, ``cpu`` the CPU tier's
allocator (:class:`kvtier.tiers.cpu.CPUBackend`). Import the module you need; nothing is
imported here, so the scheduler side does not pay for tiers it does not use.
"""

__all__: list[str] = []

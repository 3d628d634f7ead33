"""The CPU tier: the first tier of every stack, the gateway every GPU load comes through.

``region`` is the shared-memory region the tier is made of (mappable by name from the
engine's worker processes), ``slots`` the row allocator every numbered-row tier shares, and
``backend`` the tier itself (:class:`~kvtier.tiers.cpu.backend.CPUBackend`).
"""

__all__: list[str] = []

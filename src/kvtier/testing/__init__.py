"""Test doubles for code built on kvtier: in-memory tiers that run jobs when asked.

Not loaded by ``import kvtier``; tests, examples and the benchmarks import it.
"""

from kvtier.testing.memory import MemoryBackend, MemoryTier, NullBackend

__all__ = ["MemoryBackend", "MemoryTier", "NullBackend"]

"""Types of kvtier._speedups (src/kvtier/_speedups.c), the optional C hot path."""

from typing import Any

class Lookup:
    """The single-tier manager's ``lookup(key, req_context)`` over its containers."""

    def __init__(self, index: dict[Any, Any], pending: dict[Any, Any], missed: list[Any] | None) -> None: ...
    def __call__(self, key: Any, req_context: Any) -> bool: ...

def key_hashes(keys: list[Any], multipliers: bytes) -> tuple[bytearray, list[int]]: ...
def probe(
    keys: list[Any], start: int, stop: int, multipliers: bytes, slots: Any, shift: int, moves: int
) -> tuple[bytes, list[int]]: ...

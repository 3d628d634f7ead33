"""The ``cpu`` kind's configuration section: the first tier, one shared-memory region.

Only this module names the section's own keys (``path``, ``pin_memory``); the common keys
(``name``, ``capacity``, ``eviction`` ...) are :class:`kvtier.config.TierConfig`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvtier.config.checks import non_empty_str, parse_choice
from kvtier.config.schema import TierConfig

# the region implements the pin modes; the section only checks the key against them
from kvtier.tiers.cpu.region import PIN_MEMORY_CHOICES

if TYPE_CHECKING:
    from kvtier.tiers.cpu.backend import CPUBackend

__all__ = ["PIN_MEMORY_CHOICES", "CPUTierConfig"]


@dataclass(frozen=True)
class CPUTierConfig(TierConfig):
    """The CPU tier: one shared-memory region of fixed-size rows, heading every stack."""

    # the region's file (default: a fresh file under /dev/shm)
    path: str | None = None
    # pin the region for DMA with cudaHostRegister: auto (when CUDA is present), on (fail
    # if it cannot be pinned), off
    pin_memory: str = "auto"

    role: ClassVar[str] = "first"

    @classmethod
    def parse_options(cls, section: Mapping[str, object], field: str, name: str) -> dict[str, object]:
        options: dict[str, object] = {}
        if section.get("path") is not None:
            options["path"] = non_empty_str(
                section["path"],
                f"{field}.path",
                "a non-empty path string",
                "write the path as a string",
            )
        if "pin_memory" in section:
            options["pin_memory"] = parse_choice(
                section["pin_memory"], f"{field}.pin_memory", PIN_MEMORY_CHOICES, bools=True
            )
        return options

    def location(self) -> str:
        return self.path if self.path is not None else "(a fresh file under /dev/shm)"

    def options_text(self) -> str:
        return f"pin_memory={self.pin_memory}"  # the path is what location() shows

    def open_first(self, block_bytes: int, *, field: str) -> CPUBackend:
        """The tier: a :class:`~kvtier.tiers.cpu.backend.CPUBackend` sized by ``capacity``."""
        from kvtier.tiers.cpu.backend import CPUBackend

        return CPUBackend.from_config(self, block_bytes, field=field)

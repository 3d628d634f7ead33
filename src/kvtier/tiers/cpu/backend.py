"""The CPU tier: fixed-size slots in one shared-memory region.

Every load into the GPU comes from this tier and every store from the GPU lands here first
(docs/architecture.md#the-cpu-tier-is-the-gateway), so its allocator sits on the scheduler's
hot path: a slot is an ``int``, allocation and release are list slices, and the per-slot
bookkeeping is one byte.
The bytes themselves live in a :class:`~kvtier.tiers.cpu.region.SharedRegion`, one row per slot,
which workers attach to and pin for DMA, and which the disk mover reads and writes directly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from kvtier.config.units import format_size
from kvtier.errors import ConfigError
from kvtier.mediums import CPULoadStoreSpec
from kvtier.tiers.cpu.region import (
    HEADER_BYTES,
    PIN_MEMORY_CHOICES,
    SharedRegion,
    default_directory,
    row_stride_for,
    sweep_stale_regions,
)
from kvtier.tiers.cpu.slots import SlotBackend

if TYPE_CHECKING:  # the section opens this tier (CPUTierConfig.open_first), not the reverse
    from kvtier.tiers.cpu.config import CPUTierConfig

__all__ = ["CPUBackend"]


def _available_memory_bytes() -> int | None:
    """Memory the kernel can give without swapping (``MemAvailable``), or None if unknown.

    A function of its own so tests can pretend the machine is small.
    """
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _free_space_bytes(directory: str) -> int | None:
    """Bytes an unprivileged writer may still use in ``directory``'s filesystem, or None.

    Checked before anything is allocated, for the clearest early error; what makes a full
    ``/dev/shm`` an error rather than a later SIGBUS is the region reserving its pages at
    creation (``region._reserve``), which also covers room taken between this check and then.
    """
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


class CPUBackend(SlotBackend):
    """Slots of the CPU tier, medium ``"CPU"``: one row of a shared region per block.

    Who calls it: the manager owning the CPU tier, on the scheduler thread, under the
    engine's scheduler lock; it is not thread-safe on its own. Nothing here blocks on I/O:
    allocation is list slicing, and the region's memory is only touched by workers.

    Slot ids are plain ``int`` objects made once at start-up and handed out and taken back
    as the same objects, so a manager that keeps them in its index stores a reference, not
    a new int per block.
    """

    spec_type = CPULoadStoreSpec

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        path: str | None = None,
        pin_memory: str = "auto",
        field: str = "tiers[0]",
    ):
        """Create a region of ``num_blocks`` rows of ``block_bytes``; pin it per ``pin_memory``.

        Called once at start-up by whoever builds the tier stack. Blocks while the region's
        pages are reserved (a filesystem without room is a :class:`ConfigError` naming
        ``<field>.capacity``, never a SIGBUS later) and, when pinning (``auto`` with a GPU,
        or ``on``), while the driver locks every page.
        """
        if pin_memory not in PIN_MEMORY_CHOICES:
            raise ConfigError("pin_memory", pin_memory, "one of " + ", ".join(PIN_MEMORY_CHOICES))
        self.region = SharedRegion.create(num_blocks, block_bytes, path=path, field=f"{field}.capacity")
        try:
            self.region.pin(pin_memory)
        except BaseException:
            self.region.close()
            raise
        #: number of slots (rows)
        self.num_blocks = self.region.num_rows
        super().__init__(block_bytes, self.num_blocks, what="CPU block")

    @classmethod
    def from_config(cls, config: CPUTierConfig, block_bytes: int, field: str = "tiers[0]") -> CPUBackend:
        """Build the tier from its configuration, holding as many blocks as fit in its capacity.

        ``block_bytes`` is one block's size (all ranks' shards of it). Checks, before
        allocating anything, that the capacity holds at least one row and fits both in the
        memory available now and in the free space of the filesystem that will hold the file;
        each failure is a :class:`ConfigError` naming ``<field>.capacity`` (or ``.path``).
        """
        if config.pin_memory not in PIN_MEMORY_CHOICES:
            raise ConfigError(
                f"{field}.pin_memory", config.pin_memory, "one of " + ", ".join(PIN_MEMORY_CHOICES)
            )
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError("block_bytes", block_bytes, "an integer >= 1")
        capacity = config.capacity_bytes
        stride = row_stride_for(block_bytes)
        num_blocks = capacity // stride
        if num_blocks < 1:
            raise ConfigError(
                f"{field}.capacity",
                format_size(capacity),
                f"room for at least one block: {format_size(stride)} (a block of "
                f"{block_bytes} bytes rounded up to whole 4096-byte pages)",
                f"raise the capacity to {stride} bytes or more",
            )
        region_bytes = HEADER_BYTES + num_blocks * stride
        available = _available_memory_bytes()
        if available is not None and region_bytes > available:
            raise ConfigError(
                f"{field}.capacity",
                format_size(capacity),
                f"at most the memory available on this machine now "
                f"({format_size(available)}, MemAvailable in /proc/meminfo)",
                "lower the capacity, or free memory",
            )
        directory = os.path.dirname(os.path.abspath(config.path)) if config.path else default_directory()
        # Regions of runs that were killed (SIGKILL, a crash) first: they hold the room this
        # one needs, and may sit at this very path (under vLLM: kvtier-<engine id>).
        sweep_stale_regions(directory)
        free_space = _free_space_bytes(directory)
        if free_space is not None and region_bytes > free_space:
            raise ConfigError(
                f"{field}.capacity",
                format_size(capacity),
                f"at most the free space of {directory} ({format_size(free_space)})",
                f"lower the capacity, or free space in {directory} (for /dev/shm: remove "
                f"stale files, or remount it with a larger size=)",
            )
        if config.path and os.path.lexists(config.path):
            raise ConfigError(
                f"{field}.path",
                config.path,
                "a file that does not exist yet (the tier creates it and removes it at shutdown)",
                "remove the stale file or choose another path",
            )
        return cls(num_blocks, block_bytes, path=config.path, pin_memory=config.pin_memory, field=field)

    # -----------------------------------------------------------------------------------------
    # bytes and lifecycle

    @property
    def rows(self) -> np.ndarray:
        """The slots' bytes: a zero-copy ``uint8`` view of shape ``(num_blocks, block_bytes)``.

        For workers and the disk mover (any thread); row ``i`` is slot ``i``.
        """
        return self.region.rows

    def shutdown(self) -> None:
        """Unpin and release the region and remove its file. Idempotent.

        Called once by the owner at shutdown, after every transfer finished.
        """
        self.region.close()

    def __repr__(self) -> str:
        return (
            f"CPUBackend({self.num_blocks} blocks of {self.block_size} bytes, "
            f"{self.get_num_free_blocks()} free, region={self.region.path!r})"
        )

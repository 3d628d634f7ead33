"""From a configuration to a working manager: the one place that turns config into objects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.base import OffloadingManager
from kvtier.config import CPUTierConfig, DiskTierConfig, KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.policies import get_policy_class

if TYPE_CHECKING:
    from kvtier.tiers.disk.format import LayoutFingerprint

__all__ = ["build_manager"]


def build_manager(
    config: KvtierConfig | dict | str,
    block_bytes: int,
    *,
    enable_events: bool = True,
    fingerprint: LayoutFingerprint | None = None,
) -> OffloadingManager:
    """The manager for ``config`` (anything :func:`kvtier.load_config` takes).

    ``block_bytes`` is the size of one offloaded block's payload (every layer, K and V, every
    rank's shard): it sizes the tiers' rows, so a tier of ``capacity`` holds about
    ``capacity // block_bytes`` blocks (rows are padded to 4 KiB for DMA and O_DIRECT).
    ``fingerprint`` names the engine's KV layout; disk tiers serve only blocks written under
    the same one (default: a standalone layout keyed by ``block_bytes`` alone).

    A single ``cpu`` tier gives a :class:`~kvtier.manager.single.SingleTierManager`; more
    tiers a :class:`~kvtier.manager.stack.TierStackManager` over them, in config order.
    """
    config = load_config(config)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ConfigError("block_bytes", block_bytes, "a positive number of bytes")
    from kvtier.tiers.cpu.backend import CPUBackend

    cpu = config.tiers[0]
    assert isinstance(cpu, CPUTierConfig)  # load_config guarantees tiers[0] is the cpu tier
    policy_cls = get_policy_class(cpu.eviction, cpu.eviction_module_path, field="tiers[0].eviction")
    backend = CPUBackend.from_config(cpu, block_bytes, field="tiers[0]")
    policy = policy_cls(backend.get_num_free_blocks())
    if len(config.tiers) == 1:
        from kvtier.manager.single import SingleTierManager

        return SingleTierManager(backend, policy, enable_events=enable_events)

    from kvtier.manager.stack import TierStackManager
    from kvtier.tiers.disk import open_store
    from kvtier.tiers.disk.format import LayoutFingerprint

    fingerprint = fingerprint or LayoutFingerprint.standalone(block_bytes)
    lower = []
    try:
        for index, tier in enumerate(config.tiers[1:], start=1):
            assert isinstance(tier, DiskTierConfig)
            lower.append(open_store(tier, backend.rows, fingerprint, field=f"tiers[{index}]"))
    except BaseException:
        for store in lower:
            store.close()
        backend.shutdown()
        raise
    from kvtier.policies.admission import AdmissionFilter

    admission = [
        # A few sketch counters per block the tier can hold; bounded (4 rows of 1 byte each).
        AdmissionFilter(tier.admit, tier.min_reuse, sketch_width=min(1 << 22, max(
            1 << 12, 4 * (tier.capacity_bytes // block_bytes))))
        for tier in config.tiers[1:]
    ]
    endurance = [tier.endurance_tbw for tier in config.tiers[1:]]
    return TierStackManager(
        backend, policy, lower, config.cascade, enable_events=enable_events,
        admission=admission, endurance_tbw=endurance,
    )

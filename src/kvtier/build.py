"""From a configuration to a working manager: the one place that turns config into objects."""

from __future__ import annotations

from kvtier.base import OffloadingManager
from kvtier.config import CPUTierConfig, KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.policies import get_policy_class

__all__ = ["build_manager"]


def build_manager(
    config: KvtierConfig | dict | str, block_bytes: int, *, enable_events: bool = True
) -> OffloadingManager:
    """The manager for ``config`` (anything :func:`kvtier.load_config` takes).

    ``block_bytes`` is the size of one offloaded block's payload (every layer, K and V, every
    rank's shard): it sizes the tier's rows, so a tier of ``capacity`` holds about
    ``capacity // block_bytes`` blocks (rows are padded to 4 KiB for DMA and O_DIRECT).
    With a single ``cpu`` tier this is a :class:`~kvtier.managers.single.SingleTierManager`.
    """
    config = load_config(config)
    if not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ConfigError("block_bytes", block_bytes, "a positive number of bytes", None)
    if len(config.tiers) > 1:
        extra = ", ".join(f"{tier.name} ({tier.kind})" for tier in config.tiers[1:])
        raise ConfigError(
            "tiers",
            extra,
            "a single cpu tier: the tier-stack manager for disk tiers is not built yet "
            "(issue #4)",
            "remove the disk tiers for now",
        )
    from kvtier.managers.single import SingleTierManager
    from kvtier.tiers.cpu import CPUBackend

    tier = config.tiers[0]
    assert isinstance(tier, CPUTierConfig)  # load_config guarantees tiers[0] is the cpu tier
    policy_cls = get_policy_class(
        tier.eviction, tier.eviction_module_path, field="tiers[0].eviction"
    )
    backend = CPUBackend.from_config(tier, block_bytes, field="tiers[0]")
    return SingleTierManager(
        backend, policy_cls(backend.get_num_free_blocks()), enable_events=enable_events
    )

"""From a configuration to a working manager: the one place that turns config into objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.policies import get_policy_class

if TYPE_CHECKING:
    from kvtier.manager.single import SingleTierManager
    from kvtier.config.schema import TierConfig
    from kvtier.policies.admission import AdmissionFilter
    from kvtier.tiers.disk.format import LayoutFingerprint

__all__ = ["admission_filters", "build_manager"]

M = TypeVar("M", bound="SingleTierManager")


def build_manager(
    config: KvtierConfig | dict | str,
    block_bytes: int,
    *,
    enable_events: bool = True,
    fingerprint: LayoutFingerprint | None = None,
) -> SingleTierManager:
    """The manager for ``config`` (anything :func:`kvtier.load_config` takes).

    ``block_bytes`` is the size of one offloaded block's payload (every layer, K and V, every
    rank's shard): it sizes the tiers' rows, so a tier of ``capacity`` holds about
    ``capacity // block_bytes`` blocks (rows are padded to 4 KiB for DMA and O_DIRECT).
    ``fingerprint`` names the engine's KV layout; tiers that keep blocks across restarts
    serve only blocks written under the same one (default: a standalone layout keyed by
    ``block_bytes`` alone).

    Each tier's section builds its own tier, in config order (``open_first`` for tiers[0],
    ``open_lower`` for the rest): a single tier gives a
    :class:`~kvtier.manager.single.SingleTierManager`, more a
    :class:`~kvtier.manager.stack.TierStackManager` over them.
    """
    config = load_config(config)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ConfigError("block_bytes", block_bytes, "a positive number of bytes")
    first = config.tiers[0]
    policy_cls = get_policy_class(first.eviction, first.eviction_module_path, field="tiers[0].eviction")
    backend = first.open_first(block_bytes, field="tiers[0]")
    policy = policy_cls(backend.get_num_free_blocks())
    causes = None
    if config.miss_causes.enabled:
        from kvtier.manager.causes import MAX_STACK_KEYS, MAX_TIERS, MissCauses, stack_keys

        if len(config.tiers) > MAX_TIERS:
            raise ConfigError(
                "miss_causes",
                "on",
                f"a stack of at most {MAX_TIERS} tiers (it has {len(config.tiers)})",
                "set miss_causes: off",
            )
        keys = config.miss_causes.keys
        if keys is None:
            held = [tier.blocks_held(block_bytes) for tier in config.tiers[1:]]
            # a tier a server bounds (a shared store) has no capacity of its own: the most
            below = sum(MAX_STACK_KEYS if blocks is None else blocks for blocks in held)
            keys = stack_keys(backend.get_num_free_blocks(), below)
        causes = MissCauses(keys, [tier.name for tier in config.tiers])
    if len(config.tiers) == 1:
        from kvtier.manager.single import SingleTierManager

        return _reporting(
            SingleTierManager(backend, policy, enable_events=enable_events, causes=causes), config
        )

    from kvtier.manager.stack import TierStackManager
    from kvtier.tiers.disk.format import LayoutFingerprint
    from kvtier.tiers.disk.store import MAX_WIPED_KEYS

    fingerprint = fingerprint or LayoutFingerprint.standalone(block_bytes)
    # a disk store wiped for another layout lists its keys only for a sketch to remember
    options = {} if causes is None else {"wiped_keys": min(MAX_WIPED_KEYS, causes.sketch.keys)}
    lower = []
    try:
        for index, tier in enumerate(config.tiers[1:], start=1):
            lower.append(tier.open_lower(backend.rows, fingerprint, field=f"tiers[{index}]", **options))
    except BaseException:
        for opened in lower:
            opened.close()
        backend.shutdown()
        raise
    try:
        admission = admission_filters(config.tiers[1:], block_bytes)
    except BaseException:  # a budget contradicting the drive's size is found only now
        for opened in lower:
            opened.close()
        backend.shutdown()
        raise
    stack = TierStackManager(
        backend,
        policy,
        lower,
        config.cascade,
        enable_events=enable_events,
        admission=admission,
        endurance_tbw=[tier.admission()[2] for tier in config.tiers[1:]],
        receives=[tier.receives for tier in config.tiers[1:]],
        causes=causes,
    )
    return _reporting(stack, config)


def admission_filters(
    tiers: Sequence[TierConfig], block_bytes: int, field: Callable[[int], str] = "tiers[{}]".format
) -> list[AdmissionFilter]:
    """One admission filter per lower tier (``tiers`` are config's ``tiers[1:]``; ``field``
    names tiers[i] in errors), each with its write budget under ``admit: budget``: the
    caller ticks the budgets and tells them what was written."""
    from kvtier.policies.admission import AdmissionFilter

    filters = []
    for index, tier in enumerate(tiers, start=1):
        admit, min_reuse, _ = tier.admission()
        # A few sketch counters per block the tier can hold; bounded (4 rows of 1 byte each).
        width = min(1 << 22, max(1 << 12, 4 * (tier.capacity_bytes // block_bytes)))
        budget = tier.write_budget(field(index))
        filters.append(
            AdmissionFilter(admit, min_reuse, sketch_width=width, budget=budget, block_bytes=block_bytes)
        )
    return filters


def _reporting(manager: M, config: KvtierConfig) -> M:
    """Start the metrics endpoint and stats file ``config.metrics`` asks for (none by
    default); if that fails, shut ``manager`` down before raising."""
    from kvtier.metrics.report import start_reporting

    try:
        start_reporting(manager, config.metrics)
    except BaseException:
        manager.shutdown()
        raise
    return manager

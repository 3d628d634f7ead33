"""kvtier: tiered KV-cache offloading behind vLLM's kv_offload contract.

The public surface is what ``__all__`` lists; everything else is private by module or
underscore. The scheduler side (config, managers, policies) never imports torch.
"""

from kvtier.base import (
    Backend,
    BlockStatus,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LoadStoreSpec,
    LoadTiers,
    OffloadingEvent,
    OffloadingHandler,
    OffloadingManager,
    OffloadingSpec,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    TransferSpec,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvtier.build import build_manager
from kvtier.config import CascadeConfig, KvtierConfig, TierConfig, load_config
from kvtier.errors import BlockStateError, ConfigError, KvtierError
from kvtier.mediums import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.policies import EvictionPolicy
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.spec import TieredOffloadingSpec

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BlockIDsLoadStoreSpec",
    "BlockStateError",
    "BlockStatus",
    "CPULoadStoreSpec",
    "CPUTierConfig",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CascadeConfig",
    "ConfigError",
    "DiskTierConfig",
    "EvictionPolicy",
    "GPULoadStoreSpec",
    "KvtierConfig",
    "KvtierError",
    "LayoutFingerprint",
    "LoadStoreSpec",
    "LoadTiers",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingHandler",
    "OffloadingManager",
    "OffloadingSpec",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "TierConfig",
    "TieredOffloadingSpec",
    "TransferResult",
    "TransferSpec",
    "build_manager",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "load_config",
    "make_offload_key",
    "__version__",
]

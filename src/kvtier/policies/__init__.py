"""Eviction policies, chosen by name from configuration.

Built-in names map to lazily imported classes; ``eviction_module_path`` in a tier's config loads
an out-of-tree :class:`~kvtier.policies.base.EvictionPolicy` subclass by class name instead
(both through :class:`kvtier.registry.Registry`).
"""

from __future__ import annotations

from kvtier.policies.base import EvictionPolicy
from kvtier.registry import Registry

__all__ = ["POLICIES", "EvictionPolicy", "get_policy_class", "registered_policies"]

#: policy name -> "module:Class", imported on first use
POLICIES: Registry[EvictionPolicy] = Registry(
    "eviction policy",
    EvictionPolicy,
    {
        "lru": "kvtier.policies.lru:LRUPolicy",
        "arc": "kvtier.policies.arc:ARCPolicy",
        "s3fifo": "kvtier.policies.s3fifo:S3FIFOPolicy",
        "sieve": "kvtier.policies.sieve:SIEVEPolicy",
        "chain": "kvtier.policies.chain:ChainPolicy",
    },
    module_key="eviction_module_path",
)


def registered_policies() -> tuple[str, ...]:
    """Names usable as a tier's ``eviction`` without a module path."""
    return POLICIES.names()


def get_policy_class(
    name: str, module_path: str | None = None, *, field: str = "eviction"
) -> type[EvictionPolicy]:
    """The policy class for ``name`` (built-in), or class ``name`` of ``module_path``."""
    return POLICIES.resolve(name, module_path, field=field)

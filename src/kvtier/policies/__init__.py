"""Eviction policies, chosen by name from configuration.

Built-in names map to lazily imported classes; ``eviction_module_path`` in a tier's config loads
an out-of-tree :class:`~kvtier.policies.base.EvictionPolicy` subclass by class name instead.
"""

from __future__ import annotations

import importlib

from kvtier.errors import ConfigError
from kvtier.policies.base import EvictionPolicy

__all__ = ["EvictionPolicy", "get_policy_class", "registered_policies"]

_REGISTRY: dict[str, str] = {
    "lru": "kvtier.policies.lru:LRUPolicy",
    "arc": "kvtier.policies.arc:ARCPolicy",
    "s3fifo": "kvtier.policies.s3fifo:S3FIFOPolicy",
    "sieve": "kvtier.policies.sieve:SIEVEPolicy",
    "chain": "kvtier.policies.chain:ChainPolicy",
}


def registered_policies() -> tuple[str, ...]:
    """Names usable as a tier's ``eviction`` without a module path."""
    return tuple(_REGISTRY)


def _load(module_name: str, class_name: str, field: str, value: str) -> type[EvictionPolicy]:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{field}_module_path", module_name, "an importable module", f"check the module name ({exc})"
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ConfigError(
            field,
            value,
            f"the name of an EvictionPolicy subclass defined in {module_name}",
            "subclass kvtier.policies.EvictionPolicy and name that class here",
        )
    return cls


def get_policy_class(
    name: str, module_path: str | None = None, *, field: str = "eviction"
) -> type[EvictionPolicy]:
    """The policy class for ``name`` (built-in), or class ``name`` of ``module_path``."""
    if module_path is not None:
        return _load(module_path, name, field, name)
    target = _REGISTRY.get(name)
    if target is None:
        raise ConfigError(
            field,
            name,
            f"one of {', '.join(_REGISTRY)}",
            "pick a built-in policy, or set eviction_module_path to load your own class",
        )
    module_name, class_name = target.split(":")
    return _load(module_name, class_name, field, name)

"""Configuration: parsed once, at the edge, into frozen typed objects.

Nothing deeper in kvtier reads raw dicts: every tier, policy and manager is built from these
objects. The package is in layers, each importing only those above it:

* :mod:`~kvtier.config.units` sizes and counts (``64GiB``), and
  :mod:`~kvtier.config.checks` the shared value checks: they import nothing of kvtier's
  but its errors, so tiers and the shared-memory region use them freely;
* :mod:`~kvtier.config.schema` the frozen dataclasses, knowing no tier kind;
* :mod:`~kvtier.config.kinds` the kind registry (kind name -> "module:Class");
* :mod:`~kvtier.config.source`, :mod:`~kvtier.config.parse`, :mod:`~kvtier.config.load`
  reading YAML, parsing a document, and :func:`load_config`;
* :mod:`~kvtier.config.describe` the summary ``kvtier config check`` prints.

Each kind's section lives beside its tier (``kvtier/tiers/<kind>/config.py``) and imports
only ``schema``, ``checks`` and ``units``. This module re-exports the public names, so
``from kvtier.config import ...`` is the path to use.
"""

from __future__ import annotations

from kvtier.config.checks import MISSING, non_empty_str, parse_choice
from kvtier.config.describe import describe
from kvtier.config.kinds import TIER_KINDS
from kvtier.config.load import CONFIG_ENV, env_config_path, load_config
from kvtier.config.parse import parse_tier
from kvtier.config.schema import (
    RECEIVES,
    CascadeConfig,
    KvtierConfig,
    MetricsConfig,
    MissCausesConfig,
    TierConfig,
)
from kvtier.config.units import format_size, parse_size, positive_int, positive_size

# Module attributes of the old single-file kvtier.config, kept importable from here; each
# module's own __all__ is where they are documented.
from kvtier.config.schema import WRITE_POLICIES as WRITE_POLICIES
from kvtier.config.source import MAX_YAML_NODES as MAX_YAML_NODES
from kvtier.config.units import MAX_FIELD_INT as MAX_FIELD_INT
from kvtier.config.units import MAX_SIZE_TEXT as MAX_SIZE_TEXT
from kvtier.config.units import MiB as MiB

# The built-in kinds' sections, under their old path (kvtier.config.CPUTierConfig); new code
# imports them from kvtier.tiers.<kind>.config. Imported last: they import the layers above,
# never this package's façade.
from kvtier.tiers.cpu.config import CPUTierConfig
from kvtier.tiers.disk.config import DiskTierConfig

__all__ = [
    "TIER_KINDS",
    "TierConfig",
    "CPUTierConfig",
    "DiskTierConfig",
    "CascadeConfig",
    "MissCausesConfig",
    "RECEIVES",
    "KvtierConfig",
    "MetricsConfig",
    "load_config",
    "CONFIG_ENV",
    "env_config_path",
    "parse_size",
    "format_size",
    "describe",
    "parse_choice",
    "parse_tier",
    "positive_int",
    "positive_size",
    "non_empty_str",
    "MISSING",
]

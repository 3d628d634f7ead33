"""Prices: dollars per GB-month of DRAM, NVMe and a shared tier, and per GPU-hour.

A YAML or JSON file of one mapping; see ``examples/costs/prices.yaml`` (its sources and date)::

    gpu_per_hour: 2.99
    dram_per_gb_month: 3.09
    nvme_per_gb_month: 0.08
    shared_per_gb_month: 7.8   # optional: without it no shared tier is considered
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

__all__ = ["Prices", "load_prices"]

_REQUIRED = ("gpu_per_hour", "dram_per_gb_month", "nvme_per_gb_month")
_OPTIONAL = ("shared_per_gb_month",)
#: keys kept for people, not read: where the figures come from and when
_NOTES = ("date", "currency", "sources", "notes")


@dataclass(frozen=True)
class Prices:
    """Prices in one currency (dollars in the example)."""

    gpu_per_hour: float
    dram_per_gb_month: float
    nvme_per_gb_month: float
    #: ``None``: no shared tier priced, so none is considered
    shared_per_gb_month: float | None = None


def load_prices(path: str | Path) -> Prices:
    """The prices in ``path``; :class:`ConfigError` names the file and the key for a missing,
    unknown, negative or non-numeric one."""
    import yaml

    where = f"--prices {path}"
    try:
        fields = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "--prices", str(path), f"a readable YAML or JSON file ({exc})", "see examples/costs/prices.yaml"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(
            where, "unparseable", f"YAML or JSON ({exc})", "see examples/costs/prices.yaml"
        ) from exc
    if not isinstance(fields, dict):
        raise ConfigError(where, fields, "a mapping of prices", "see examples/costs/prices.yaml")
    known = (*_REQUIRED, *_OPTIONAL, *_NOTES)
    for key in fields:
        if key not in known:
            raise ConfigError(
                f"{where}: {key}", fields[key], f"a key among {', '.join(known)}", "remove or rename it"
            )
    values: dict[str, float] = {}
    for key in (*_REQUIRED, *_OPTIONAL):
        if key not in fields:
            if key in _REQUIRED:
                raise ConfigError(f"{where}: {key}", None, "a price (a number >= 0)", f"add {key}: N")
            continue
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ConfigError(f"{where}: {key}", value, "a price (a number >= 0)", f"e.g. {key}: 1.5")
        values[key] = float(value)
    return Prices(**values)

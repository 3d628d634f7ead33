"""How fast each tier kind loads blocks: a default per kind, or ``kvtier bench`` JSON records.

Defaults (GB/s, 10^9 bytes): ``cpu`` is the GPU's host link (its datasheet's PCIe figure per
direction, an upper bound: a copy reaches less); the others are what this project's own
benchmarks measured on its development machine (docs/bench.md, docs/tiers/valkey.md), so they
are only a starting point: measure yours with ``kvtier bench transfer|disk|remote --json`` and
pass the lines with ``--bandwidth FILE``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

__all__ = [
    "DEFAULT_CODEC_COSTS",
    "DEFAULT_LOAD_GBPS",
    "HOST_LINK",
    "CodecCost",
    "codec_cost",
    "read_bandwidth_file",
]

#: the kinds whose default is the GPU's host link rather than a figure of :data:`DEFAULT_LOAD_GBPS`
HOST_LINK = ("cpu", "memory")

#: a lower tier kind's read speed when no record gives one: (GB/s, where the figure comes from)
DEFAULT_LOAD_GBPS: dict[str, tuple[float, str]] = {
    "files": (2.16, "docs/bench.md: kvtier bench disk, files backend, cold reads (virtio disk)"),
    "lmdb": (2.16, "docs/bench.md: kvtier bench disk, lmdb backend, cold reads (virtio disk)"),
    "valkey": (1.31, "docs/tiers/valkey.md: kvtier bench remote, tier load at 2 MiB, loopback"),
    "redis": (1.31, "as valkey (the same protocol and client)"),
}


@dataclass(frozen=True)
class CodecCost:
    """What a codec costs a load: raw bytes per stored byte, and how fast it decodes."""

    name: str
    #: bytes of a block over the bytes stored for it (on bf16 KV)
    ratio: float
    #: GB/s of raw block bytes a decode gives back on one core
    decode_gbps: float
    source: str


#: each codec's ratio on bf16 KV and its decode speed on one core, when no ``bench codec``
#: record gives them: this project's measurement on SmolLM2-135M's KV (docs/results.md#codecs;
#: the lossy ratios are exact for any bf16 KV), a starting point for other machines
DEFAULT_CODEC_COSTS: dict[str, CodecCost] = {
    name: CodecCost(name, ratio, decode, "docs/results.md#codecs: kvtier bench codec --model smollm2")
    for name, ratio, decode in (
        ("lossless", 1.45, 2.1),
        ("int8", 128 / 66, 3.48),
        ("fp8", 128 / 66, 1.79),
        ("int4", 64 / 20, 2.0),
    )
}


def codec_cost(name: str, measured: Mapping[str, tuple[float, str]] | None = None) -> CodecCost:
    """The cost of codec ``name``: its decode speed from a ``bench codec`` record in
    ``measured`` (key ``codec:<name>``), else the default; :class:`ConfigError` for a codec
    with neither (one from outside kvtier: measure it)."""
    default = DEFAULT_CODEC_COSTS.get(name)
    found = (measured or {}).get(f"codec:{name}")
    ratio = (measured or {}).get(f"codec:{name}:ratio")
    if default is None and (found is None or ratio is None):
        raise ConfigError(
            "codec",
            name,
            f"a codec with a known cost ({', '.join(DEFAULT_CODEC_COSTS)}) or a measured one",
            "give --bandwidth FILE with its kvtier bench codec --json line",
        )
    if found is None:
        assert default is not None
        return default
    return CodecCost(name, ratio[0] if ratio is not None else default.ratio, found[0], found[1])  # type: ignore[union-attr]


def read_bandwidth_file(path: str | Path) -> dict[str, tuple[float, str]]:
    """Load speeds by tier kind (or tier name) from ``path``: JSON lines (or one JSON array)
    of ``kvtier bench`` records, or one object mapping a kind or name to GB/s.

    From ``bench transfer`` the best ``h2d_gbps`` of its rows gives ``cpu``; from ``bench disk``
    ``read_gbps`` gives its ``backend``; from ``bench remote`` the largest block size's
    ``tier_load_gbps`` gives ``valkey``. Raises :class:`ConfigError` naming the file and what
    is wrong with it.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "--bandwidth", str(path), f"a readable file ({exc})", "give kvtier bench --json output"
        ) from exc
    records: list[object] = []
    try:
        whole = json.loads(text)
        records = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip().startswith("{"):
                continue  # a bench's table lines before its JSON line
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--bandwidth {path}:{number}", line[:60], f"a JSON line ({exc})", ""
                ) from exc
    found: dict[str, tuple[float, str]] = {}
    for record in records:
        if not isinstance(record, dict):
            raise ConfigError(
                f"--bandwidth {path}", record, "JSON objects", "give kvtier bench --json output"
            )
        found.update(_speeds(record, path))
    if not found:
        raise ConfigError(
            f"--bandwidth {path}",
            "no load speed",
            'bench transfer/disk/remote records, or {"lmdb": 2.0, ...}',
            "run kvtier bench disk --json > FILE",
        )
    return found


def _speeds(record: dict, path: Path) -> dict[str, tuple[float, str]]:
    where = f"{path}: kvtier bench {record.get('bench')}"
    bench = record.get("bench")
    if bench == "transfer":
        rows = [row for row in record.get("rows", []) if isinstance(row, dict)]
        rates = [float(row["h2d_gbps"]) for row in rows if isinstance(row.get("h2d_gbps"), (int, float))]
        rates = [rate for rate in rates if rate > 0]
        return {"cpu": (max(rates), where)} if rates else {}
    if bench == "disk" and isinstance(record.get("read_gbps"), (int, float)):
        return {str(record.get("backend")): (float(record["read_gbps"]), where)}
    if bench == "remote":
        loads = {
            int(key.split("k_", 1)[0]): value
            for key, value in record.items()
            if key.endswith("k_tier_load_gbps") and key.split("k_", 1)[0].isdigit()
        }
        return {"valkey": (loads[max(loads)], where)} if loads else {}
    if bench == "codec" and isinstance(record.get("codecs"), dict):
        found: dict[str, tuple[float, str]] = {}
        for name, figures in record["codecs"].items():
            if name != "none" and isinstance(figures, dict) and figures.get("decode_gbps"):
                found[f"codec:{name}"] = (float(figures["decode_gbps"]), where)
                found[f"codec:{name}:ratio"] = (float(figures["ratio"]), where)
        return found
    if bench is None:
        speeds = {}
        for key, value in record.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(
                    f"--bandwidth {path}: {key}", value, "a positive GB/s figure", 'e.g. {"lmdb": 2.0}'
                )
            speeds[str(key)] = (float(value), str(path))
        return speeds
    return {}

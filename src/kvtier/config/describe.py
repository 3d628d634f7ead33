"""``describe``: a configuration as the table ``kvtier config check`` prints."""

from __future__ import annotations

from kvtier.config.schema import KvtierConfig
from kvtier.config.units import describe_size

__all__ = ["describe"]


def describe(config: KvtierConfig) -> str:
    """A multi-line summary of the stack, fastest tier first, for ``kvtier config check``."""
    rows = []
    for index, tier in enumerate(config.tiers):
        eviction = tier.eviction
        if tier.eviction_module_path is not None:
            eviction += f" (from {tier.eviction_module_path})"
        where = tier.location() or "(none)"
        options = tier.options_text()
        if index:  # how the tier fills: the first tier receives every block from the GPU
            options = f"receives={tier.receives}  {options}".rstrip()
        rows.append(
            (
                f"[{index}]",
                tier.name,
                tier.kind,
                "(server's)" if tier.bounded_by_server else describe_size(tier.capacity_bytes),
                f"eviction={eviction}",
                f"at={where}",
                options,
            )
        )
    # columns padded to their widest cell, so that tiers read as a table
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    count = len(config.tiers)
    lines = [f"kvtier stack: {count} tier{'s' if count != 1 else ''}, fastest first"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  " + "  ".join(cells).rstrip())
    block = config.block_size_tokens
    lines.append("block_size_tokens: " + (f"{block}" if block is not None else "the engine's GPU block size"))
    cascade = config.cascade
    lines.append(
        f"cascade: write_policy={cascade.write_policy}  "
        f"max_demote_bytes_per_step={describe_size(cascade.max_demote_bytes_per_step)}  "
        f"max_promote_bytes_per_step={describe_size(cascade.max_promote_bytes_per_step)}"
    )
    keys = config.miss_causes.keys
    if keys is None:
        lines.append("miss_causes: on, keys remembered sized from the stack's capacity")
    else:
        lines.append(f"miss_causes: {keys} keys remembered" if keys else "miss_causes: off")
    metrics = config.metrics
    reported = []
    if metrics.port is not None:
        reported.append(f"endpoint http://{metrics.addr}:{metrics.port}/metrics")
    if metrics.unix_socket is not None:
        reported.append(f"endpoint on the unix socket {metrics.unix_socket}")
    if metrics.stats_file is not None:
        reported.append(f"stats_file {metrics.stats_file} every {metrics.stats_interval_s:g} s")
    lines.append("metrics: " + (", ".join(reported) if reported else "off"))
    return "\n".join(lines)

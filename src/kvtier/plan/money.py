"""``kvtier plan --prices``: GPU-seconds saved per dollar for each combination of tier sizes.

The stack is GPU cache -> DRAM (the CPU tier) -> NVMe -> a shared tier, each tier sized from
the planner's capacities (or absent). Hits per tier follow from the planner's pooled-cache
curves by inclusion: a tier at cumulative size ``S`` (the largest of its size and those above
it) serves ``h(S) - h(S above)`` of the references, where ``h`` is a hit-ratio curve (the best
online policy at each size, or Belady's) and the GPU cache's own hits come from the replay's
LRU model of it (:func:`~kvtier.replay.ttft.gpu_only_served`). LRU has this inclusion
property; a write-back stack keeps most blocks below as well as in DRAM, so it is close.

A block served by a tier saves its prefill and costs its load: ``hits x (compute - load)``,
where ``compute`` is the trace's prefill seconds per block with every request computed whole
(:class:`~kvtier.costs.CostModel`): hits do not say which blocks they were, so a hit is
priced as the mean block. The cost of a stack is
its capacity x price over the trace's duration; the recommendation is the cheapest stack
whose saving reaches ``target`` of the largest saving of any combination.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TextIO

from kvtier.bench.report import print_table, pyplot, save_figure
from kvtier.config.units import format_size
from kvtier.costs.prices import Prices
from kvtier.costs.queue import BLOCK_TOKENS
from kvtier.costs.timing import CostModel, TierSpeed, tier_speeds
from kvtier.errors import KvtierError
from kvtier.replay.trace import Request

__all__ = ["LEVELS", "block_bytes", "money_plan", "print_money", "stack_cost"]

#: the tiers a plan prices: (name, kind, the price's key)
LEVELS = (
    ("dram", "cpu", "dram_per_gb_month"),
    ("nvme", "lmdb", "nvme_per_gb_month"),
    ("shared", "valkey", "shared_per_gb_month"),
)
#: seconds in the month a GB-month price covers: 730 hours, as cloud price lists count it
MONTH_S = 730 * 3600


def block_bytes(model: Any) -> int:
    """The bytes of ``model``'s KV in one trace block (:data:`~kvtier.costs.queue.BLOCK_TOKENS`)."""
    return model.kv_bytes_per_token * BLOCK_TOKENS


def stack_cost(model: Any, gpu: Any, measured: Any) -> CostModel:
    """The cost model of the priced stack's tiers (``dram``, ``nvme``, ``shared``)."""
    speeds: list[TierSpeed] = tier_speeds([(name, kind) for name, kind, _ in LEVELS], gpu, measured)
    return CostModel(model, gpu, {speed.name: speed for speed in speeds})


def _curve(capacities: Sequence[int], ratios: Sequence[float]) -> dict[int, float]:
    return {0: 0.0, **dict(zip(capacities, ratios))}


def money_plan(
    cost: CostModel,
    prices: Prices,
    requests: Sequence[Request],
    capacities: Sequence[int],
    online: Sequence[float],
    belady: Sequence[float],
    gpu_hit_blocks: int,
    target: float = 0.9,
) -> dict[str, Any]:
    """Each combination's cost and saving, online and Belady's, and the recommendation."""
    if not requests:
        raise KvtierError("plan --prices: the trace has no request to price")
    refs = sum(len(request.hash_ids) for request in requests)
    mean_prompt = round(sum(r.input_length for r in requests) / len(requests))
    stamps = [request.timestamp_ms for request in requests]
    duration_s = max(1.0, (max(stamps) - min(stamps)) / 1000)  # the tiers are paid for this long
    # the trace's prefill seconds per block, every request computed whole: long prompts weigh
    # more (attention grows with the context), as they do on the GPU
    compute_block = sum(cost.prefill_seconds(r.input_length) for r in requests) / refs if refs else 0.0
    load_block = {name: cost.load_seconds(name, BLOCK_TOKENS) for name, _, _ in LEVELS}
    block_gb = block_bytes(cost.model) / 1e9  # prices are per GB (10^9 bytes)-month
    levels = [level for level in LEVELS if getattr(prices, level[2]) is not None]
    curves = {"online": _curve(capacities, online), "belady": _curve(capacities, belady)}
    gpu_hits = gpu_hit_blocks / refs if refs else 0.0

    rows = []
    for sizes in itertools.product([0, *capacities], repeat=len(levels)):
        dollars = sum(
            size * block_gb * getattr(prices, key) * duration_s / MONTH_S
            for size, (_, _, key) in zip(sizes, levels)
        )
        row: dict[str, Any] = {name: size for size, (name, _, _) in zip(sizes, levels)}
        row["dollars"] = dollars
        for label, curve in curves.items():
            covered, above, saved = 0, gpu_hits, 0.0
            for size, (name, _, _) in zip(sizes, levels):
                covered = max(covered, size)
                share = max(above, curve[covered]) - above
                saved += share * refs * (compute_block - load_block[name])
                above += share
            row[f"saved_s_{label}"] = saved
        row["saved_per_dollar"] = row["saved_s_online"] / dollars if dollars else None
        row["net_dollars"] = row["saved_s_online"] * prices.gpu_per_hour / 3600 - dollars
        rows.append(row)
    best = max(row["saved_s_online"] for row in rows)
    reaching = [row for row in rows if best > 0 and row["saved_s_online"] >= target * best]
    pick = min(reaching, key=lambda row: (row["dollars"], -row["saved_s_online"])) if reaching else None
    return {
        "target": target,
        "duration_s": duration_s,
        "mean_prompt_tokens": mean_prompt,
        "block_gb": block_gb,
        "block_bytes": block_bytes(cost.model),
        "compute_s_per_block": compute_block,
        "load_s_per_block": load_block,
        "gpu_hit_blocks": gpu_hit_blocks,
        "break_even": cost.break_even(mean_prompt),
        "prices": {key: value for key, value in vars(prices).items()},
        "best_saved_s": best,
        "combinations": rows,
        "recommend": pick,
        # what pays most once the GPU time saved is priced too (none: no stack pays for itself)
        "best_net": max(rows, key=lambda row: row["net_dollars"]),
    }


def print_money(record: dict[str, Any], out: TextIO, top: int = 12) -> None:
    """The break-even, the combinations saving most per dollar, and the recommendation."""
    from kvtier.replay.ttft import print_break_even

    print_break_even(record["break_even"], out)
    levels = [name for name, _, _ in LEVELS if name in record["combinations"][0]]
    print(
        f"GPU-seconds saved over the trace ({record['duration_s']:.0f} s) against the GPU cache alone, "
        f"per combination of tier sizes (blocks of {format_size(record['block_bytes'])}); the {top} saving most per dollar:",
        file=out,
    )
    ranked = sorted(
        (row for row in record["combinations"] if row["saved_per_dollar"] is not None),
        key=lambda row: -row["saved_per_dollar"],
    )
    columns = [*levels, "dollars", "saved_s_online", "saved_s_belady", "saved_per_dollar", "net_dollars"]
    print_table(ranked[:top], columns, out)
    pick = record["recommend"]
    if pick is None:
        print("no combination saves GPU time: every tier is below the break-even, or nothing hits", file=out)
        return
    sizes = ", ".join(
        f"{name} {pick[name]} blocks ({format_size(pick[name] * record['block_bytes'])})" for name in levels
    )
    print(
        f"recommended (the cheapest within {record['target']:.0%} of the best saving, {record['best_saved_s']:.4g} "
        f"GPU-s): {sizes}: saves {pick['saved_s_online']:.4g} GPU-s (Belady's bound at these sizes "
        f"{pick['saved_s_belady']:.4g}) for ${pick['dollars']:.4g}, net ${pick['net_dollars']:.4g} over the trace",
        file=out,
    )
    top_net = record["best_net"]
    sizes = ", ".join(f"{name} {top_net[name]}" for name in levels)
    print(
        f"largest net (GPU time saved at ${record['prices']['gpu_per_hour']:g}/GPU-hour minus the tiers' cost): "
        f"{sizes} blocks, net ${top_net['net_dollars']:.4g} over the trace",
        file=out,
    )


def plot_money(record: dict[str, Any], path: str) -> None:
    """Saving against cost, one point per combination, online and Belady's; the pick circled."""
    plt = pyplot("--money-plot")
    rows = record["combinations"]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.scatter(
        [r["dollars"] for r in rows], [r["saved_s_belady"] for r in rows], s=10, color="grey", label="Belady"
    )
    axes.scatter(
        [r["dollars"] for r in rows], [r["saved_s_online"] for r in rows], s=10, label="best online policy"
    )
    pick = record["recommend"]
    if pick is not None:
        axes.scatter(
            [pick["dollars"]],
            [pick["saved_s_online"]],
            s=120,
            facecolors="none",
            edgecolors="red",
            label="recommended",
        )
    axes.set_xscale("symlog", linthresh=1e-3)
    axes.set_xlabel("tier cost over the trace ($)")
    axes.set_ylabel("GPU-seconds saved")
    axes.legend()
    figure.tight_layout()
    save_figure(plt, figure, path, "--money-plot")

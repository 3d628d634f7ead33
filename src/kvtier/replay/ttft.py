"""``kvtier replay --model/--gpu``: the replay's hits priced in time, beside the GPU cache alone.

The replay tells, per request, which blocks the GPU cache, the CPU tier and each lower tier
served (:attr:`~kvtier.replay.engine.ReplayCounts.served`); the baseline is the same GPU
prefix cache with nothing below it (:func:`gpu_only_served`, bookkeeping only: with no
offloading every block a request names still ends in the GPU cache, computed instead of
loaded). Both go through the same prefill queue (:mod:`kvtier.costs.queue`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TextIO

from kvtier.bench.report import print_table
from kvtier.costs.queue import BLOCK_TOKENS, QueueResult, request_service, run_queue
from kvtier.costs.timing import CostModel
from kvtier.replay.trace import Request

__all__ = ["MODEL_NOTE", "fleet_time", "gpu_only_served", "time_record", "print_time"]

#: what the estimate models and leaves out; printed with it
MODEL_NOTE = (
    "modelled: a FIFO single-server prefill queue at the trace's arrival times, each request's "
    "service = its hits' load time from the tier that served them + its missed tokens' prefill; "
    "not modelled: batching, decode interference, loads overlapping other requests' compute"
)


def gpu_only_served(requests: Sequence[Request], gpu_blocks: int) -> list[dict[str, int]]:
    """Per request, its GPU prefix hits and computed blocks with the GPU cache alone: an LRU of
    ``gpu_blocks`` blocks, as the replay engine keeps it (the request's prefix hits become
    newest, the rest is computed into blocks taken from the least recently used)."""
    cache: OrderedDict[int, None] = OrderedDict()
    served = []
    for request in requests:
        chain = request.hash_ids
        hits = 0
        while hits < len(chain) and chain[hits] in cache:
            cache.move_to_end(chain[hits])
            hits += 1
        rest = chain[hits:]
        for block in rest:
            cache.pop(block, None)
        while cache and len(cache) + len(rest) > gpu_blocks:
            cache.popitem(last=False)  # the prefix hits are newest: never taken first
        for block in rest:
            cache[block] = None
        served.append({"gpu": hits, "computed": len(rest)} if hits else {"computed": len(rest)})
    return served


def time_record(
    cost: CostModel,
    requests: Sequence[Request],
    served: Sequence[dict[str, int]],
    gpu_blocks: int,
    arrival_scale: float = 1.0,
    cpu_only_served: Sequence[dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The JSON record of the time model: TTFT percentiles and GPU-seconds, the stack's and the
    GPU cache's alone, their ratios, and the break-even per tier. ``arrival_scale`` stretches
    the arrival times (a trace recorded on a cluster, served here by one GPU).
    ``cpu_only_served``: the replay's run through the CPU tier alone, priced the same way
    (``cpu_only``), which shows what the tiers below it add in time."""
    arrivals = [request.timestamp_ms / 1000 * arrival_scale for request in requests]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    stack = run_queue(arrivals, [request_service(cost, r.input_length, s) for r, s in zip(requests, served)])
    alone_served = gpu_only_served(requests, gpu_blocks)
    alone = run_queue(
        arrivals, [request_service(cost, r.input_length, s) for r, s in zip(requests, alone_served)]
    )
    mean_prompt = round(sum(r.input_length for r in requests) / len(requests)) if requests else BLOCK_TOKENS
    ours, theirs = stack.summary(), alone.summary()
    # the GPU's busy seconds per second of arrivals: above 1 the queue grows without end
    loads = {
        name: (result.compute_s + result.load_s) / span if span else None
        for name, result in (("stack", stack), ("gpu_only", alone))
    }
    record: dict[str, Any] = {
        "arrival_scale": arrival_scale,
        **cost.describe(),
        "note": MODEL_NOTE,
        "break_even": cost.break_even(mean_prompt),
        "stack": {**ours, "offered_load": loads["stack"]},
        "gpu_only": {
            **theirs,
            "offered_load": loads["gpu_only"],
            "gpu_hit_blocks": sum(s.get("gpu", 0) for s in alone_served),
        },
        "speedup": {
            key: theirs[key] / ours[key] if ours[key] else None
            for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "gpu_seconds")
        },
        "gpu_seconds_saved": theirs["gpu_seconds"] - ours["gpu_seconds"],
        # the queue's server is busy through loads too: what ``plan --prices`` calls saved
        "busy_seconds_saved": theirs["gpu_seconds"]
        + theirs["load_seconds"]
        - ours["gpu_seconds"]
        - ours["load_seconds"],
    }
    if cpu_only_served is not None:
        services = [request_service(cost, r.input_length, s) for r, s in zip(requests, cpu_only_served)]
        cpu_run = run_queue(arrivals, services)
        busy = (cpu_run.compute_s + cpu_run.load_s) / span if span else None
        record["cpu_only"] = {**cpu_run.summary(), "offered_load": busy}
    return record


def fleet_time(
    cost: CostModel,
    shares: Sequence[Sequence[Request]],
    served: Sequence[Sequence[dict[str, int]]],
    arrival_scale: float = 1.0,
) -> dict[str, Any]:
    """A fleet's TTFT percentiles and GPU-seconds: each engine one prefill queue over the
    requests it was sent (``shares[i]``, in order, and what served their blocks,
    ``served[i]``), the percentiles over every request of the fleet. ``offered_load``: the
    busiest engine's busy seconds per second of the fleet's arrivals (above 1 its queue grows
    without end)."""
    ttft: list[float] = []
    compute_s = load_s = makespan_s = busiest_s = 0.0
    stamps = [request.timestamp_ms for requests in shares for request in requests]
    span = (max(stamps) - min(stamps)) / 1000 * arrival_scale if stamps else 0.0
    for requests, blocks in zip(shares, served):
        arrivals = [request.timestamp_ms / 1000 * arrival_scale for request in requests]
        queue = run_queue(
            arrivals, [request_service(cost, r.input_length, s) for r, s in zip(requests, blocks)]
        )
        ttft += queue.ttft_s
        compute_s += queue.compute_s
        load_s += queue.load_s
        makespan_s = max(makespan_s, queue.makespan_s)
        busiest_s = max(busiest_s, queue.compute_s + queue.load_s)
    summary = QueueResult(ttft, compute_s, load_s, makespan_s).summary()
    return {**summary, "offered_load": busiest_s / span if span else None}


def print_break_even(figures: dict[str, Any], out: TextIO) -> None:
    """The break-even line and a row per tier, with a warning for each tier below it."""
    print(
        f"break-even load speed: {figures['break_even_gbps']:.3g} GB/s = {figures['kv_bytes_per_token']} "
        f"KV bytes/token x {figures['prefill_tokens_per_s']:.0f} prefill tokens/s "
        f"(prompts of {figures['prompt_tokens']} tokens)",
        file=out,
    )
    rows = [{"tier": name, **speed} for name, speed in figures["tiers"].items()]
    print_table(rows, ["tier", "kind", "gbps", "effective_gbps", "speedup_vs_recompute"], out)
    for name, speed in figures["tiers"].items():
        if speed["below_break_even"]:
            print(
                f"warning: tier {name!r} loads at {speed['effective_gbps']:.3g} GB/s into the GPU, below "
                f"the break-even {figures['break_even_gbps']:.3g} GB/s: recomputing its blocks is faster",
                file=out,
            )
        if speed.get("codec"):
            verdict = (
                "slower than without it: the tier reads faster than the codec decodes what it saves"
                if speed["codec_slows_loads"]
                else "faster than without it"
            )
            print(
                f"tier {name!r}: codec {speed['codec']} ({speed['codec_ratio']:.2f}x, decoding "
                f"{speed['decode_gbps']:.3g} GB/s on one core) makes its loads {verdict} (it loses "
                f"wherever the tier reads above {speed['codec_loses_above_gbps']:.3g} GB/s)",
                file=out,
            )


def print_time(record: dict[str, Any], out: TextIO) -> None:
    """The time model's table: the stack and the GPU cache alone side by side."""
    model, gpu = record["model"], record["gpu"]
    rate = (
        f"measured {gpu['prefill_tokens_per_s']:.0f} tokens/s"
        if gpu["prefill_tokens_per_s"]
        else f"MFU {gpu['mfu']}"
    )
    print(
        f"time model: {model['name']} ({model['kv_bytes_per_token']} KV bytes/token) on {gpu['name']} "
        f"({gpu['tflops']:g} TFLOPS, {rate}, PCIe {gpu['pcie_gbps']:g} GB/s)",
        file=out,
    )
    print_break_even(record["break_even"], out)
    columns = [
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "ttft_mean_s",
        "gpu_seconds",
        "load_seconds",
        "offered_load",
    ]
    rows = [
        {"run": "kvtier stack", **record["stack"]},
        *([{"run": "CPU tier alone", **record["cpu_only"]}] if "cpu_only" in record else []),
        {"run": "GPU cache alone", **record["gpu_only"]},
        {"run": "speed-up vs GPU alone", **record["speedup"]},
    ]
    print_table(rows, ["run", *columns], out)
    print(
        f"GPU-seconds saved against the GPU cache alone: {record['gpu_seconds_saved']:.4g} of prefill, "
        f"{record['busy_seconds_saved']:.4g} counting the loads' time",
        file=out,
    )
    print(record["note"], file=out)
    if record["gpu_only"]["offered_load"] and record["gpu_only"]["offered_load"] > 1:
        print(
            f"(offered load above 1: the queue grows through the trace; arrivals x{record['arrival_scale']:g}, "
            "--arrival-scale stretches them, as for a trace recorded on several GPUs)",
            file=out,
        )

"""``kvtier replay``: set up the stack, replay the trace, report (table, JSON line, plot)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, TextIO, cast

from kvtier.bench.report import print_json, print_table, progress_bar, pyplot, save_figure
from kvtier.config import KvtierConfig, MetricsConfig, load_config
from kvtier.cuda import resolve_device
from kvtier.errors import KvtierError
from kvtier.replay.engine import ReplayEngine
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, bundled_trace_path, ceiling_hit_ratio, load_trace
from kvtier.tiers.cpu.region import row_stride_for
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.store import scratch_directory

__all__ = ["replay", "default_config", "in_trace_blocks"]

DEFAULT_GPU_BLOCKS = 2000
DEFAULT_CPU_BLOCKS = 8000
DEFAULT_DISK_BLOCKS = 60000
#: payload of one replayed block: small, so the bundled trace replays in about a minute here
DEFAULT_BLOCK_BYTES = 16 * 1024
#: what a disk tier spends per block beyond the payload row (its header page)
DISK_HEADER_BYTES = 4096


def default_config(directory: str, block_bytes: int, disk_kind: str = "lmdb") -> dict[str, Any]:
    """The stack ``kvtier replay`` uses without ``--config``: a CPU tier of 8,000 blocks above
    a ``disk_kind`` tier of 60,000 blocks in ``directory`` (the trace has 43,924 distinct)."""
    stride = row_stride_for(block_bytes)
    return {
        "block_size_tokens": TRACE_BLOCK_TOKENS,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": DEFAULT_CPU_BLOCKS * stride, "eviction": "lru"},
            {
                "name": "disk",
                "kind": disk_kind,
                "path": str(Path(directory) / f"kvtier-{disk_kind}"),
                "capacity": DEFAULT_DISK_BLOCKS * (stride + DISK_HEADER_BYTES),
                "eviction": "lru",
                "fsync": "none",
            },
        ],
    }


def in_trace_blocks(config: KvtierConfig) -> KvtierConfig:
    """``config`` with the trace's blocks: one offloaded block per 512-token trace block.

    A trace names prompts in 512-token blocks and a replay moves ``--block-bytes`` per block,
    so a configuration's ``block_size_tokens`` (an engine's choice: 256 tokens of its GPU
    blocks, say) has nothing to group here. It is set aside, with a note on stderr, so that a
    stack written for an engine (``examples/cpu-lmdb.yaml``) replays as it is.
    """
    tokens = config.block_size_tokens
    if tokens in (None, TRACE_BLOCK_TOKENS):
        return config
    print(
        f"kvtier replay: block_size_tokens: {tokens} is the engine's block; a replay's blocks are "
        f"the trace's ({TRACE_BLOCK_TOKENS} tokens, --block-bytes each)",
        file=sys.stderr,
    )
    return dataclasses.replace(config, block_size_tokens=TRACE_BLOCK_TOKENS)


def _codecs(config: KvtierConfig) -> dict[str, str]:
    """The lower tiers' codecs by tier name (those with one)."""
    return {
        tier.name: getattr(tier, "codec", "none")
        for tier in config.tiers[1:]
        if getattr(tier, "codec", "none") != "none"  # a kind without codecs has no such field
    }


def _kv_dtype(config: KvtierConfig) -> str:
    """The replayed KV's element dtype: bf16 values when a tier stores them with a codec
    (which reads them as values), raw bytes otherwise."""
    return "bfloat16" if _codecs(config) else "uint8"


def with_codec(config: KvtierConfig, codec: str) -> KvtierConfig:
    """``config`` with every lower tier that takes a codec storing blocks with ``codec``."""
    from kvtier.codecs import parse_codec_option

    parse_codec_option({"codec": codec}, "--codec")  # a name it knows, or ConfigError
    tiers = [
        dataclasses.replace(cast(Any, tier), codec=codec) if hasattr(tier, "codec") else tier
        for tier in config.tiers
    ]
    if tiers == list(config.tiers) and codec != "none":
        raise KvtierError(
            f"--codec {codec}: no tier below the CPU tier takes a codec (disk or valkey kinds do)"
        )
    return dataclasses.replace(config, tiers=tuple(tiers))


def _held(config: KvtierConfig, stats: dict[str, Any], block_bytes: int) -> dict[str, dict[str, Any]]:
    """Per lower tier: its codec, the blocks it can hold in its bytes (and without the codec,
    for a disk tier), and the ratio its codec achieved on the blocks it wrote."""
    from kvtier.tiers.disk.format import on_disk_block_bytes

    held = {}
    for tier in config.tiers[1:]:
        name = tier.name
        raw, stored = stats.get(f"{name}.codec_block_bytes", 0), stats.get(f"{name}.codec_stored_bytes", 0)
        held[name] = {
            "codec": getattr(tier, "codec", "none"),
            "capacity_bytes": tier.capacity_bytes,
            "capacity_blocks": stats.get(f"{name}.capacity_blocks"),
            # a disk tier's room without a codec, from the same bytes
            "raw_capacity_blocks": tier.capacity_bytes // on_disk_block_bytes(block_bytes)
            if tier.capacity_bytes
            else None,
            "codec_ratio": raw / stored if stored else None,
        }
    return held


def _cpu_only(config: KvtierConfig) -> KvtierConfig:
    # the baseline reports nothing: the endpoint and stats file belong to the stack replayed
    return dataclasses.replace(config, tiers=config.tiers[:1], metrics=MetricsConfig())


def _run_one(
    config: KvtierConfig,
    requests,
    gpu_blocks: int,
    block_bytes: int,
    progress: bool,
    label: str,
    device: str = "cpu",
    deterministic: bool = False,
):
    from kvtier.spec import TieredOffloadingSpec

    spec = TieredOffloadingSpec(
        config,
        gpu_block_size_tokens=TRACE_BLOCK_TOKENS,
        page_bytes=[block_bytes],
        kv_dtype=_kv_dtype(config),
    )
    engine = ReplayEngine(spec, gpu_blocks, device, deterministic=deterministic)
    try:
        _warn_warm(config, engine.manager.stats() if hasattr(engine.manager, "stats") else {})
        with progress_bar(len(requests), label, progress) as bar:
            elapsed = engine.run(requests, progress=bar.update, total=len(requests))
        stats = engine.manager.stats() if hasattr(engine.manager, "stats") else {}
    finally:
        start = time.perf_counter()
        engine.close()  # saves the blocks only the CPU tier holds (write_back keeps them there)
        engine.counts.shutdown_s = time.perf_counter() - start
    # what the shutdown wrote below: the stack's figures once everything was saved
    final = engine.manager.stats() if hasattr(engine.manager, "stats") else {}
    engine.counts.shutdown_bytes_written = {
        name.removesuffix(".demoted_bytes"): value - stats.get(name, 0)
        for name, value in final.items()
        if name.endswith(".demoted_bytes")
    }
    return engine.counts, stats, elapsed


def _warn_warm(config: KvtierConfig, opened: dict[str, Any]) -> None:
    """Say so when a lower tier opens holding blocks (a persistent store an earlier run
    filled): the hit ratio then counts them, and may pass the trace's own ceiling."""
    for tier in config.tiers[1:]:
        held = opened.get(f"{tier.name}.blocks", 0)
        if held:
            fix = (
                "--fresh empties kvtier's store there first"
                if isinstance(tier, DiskTierConfig)
                else "give the tier a namespace of its own for a clean start (--fresh empties disk stores only)"
            )
            print(
                f"kvtier replay: warning: tier {tier.name} ({tier.location()}) already holds {held} "
                f"blocks from earlier runs: the hits count them, so the hit ratio is not the trace's "
                f"alone and may reach past its ceiling; {fix}",
                file=sys.stderr,
            )


def empty_stores(config: KvtierConfig) -> list[str]:
    """``--fresh``: empty the disk stores ``config`` names (kvtier's own stores only, see
    :func:`~kvtier.tiers.disk.store.empty_store`); the paths emptied."""
    from kvtier.tiers.disk.store import empty_store

    return [
        tier.path
        for index, tier in enumerate(config.tiers)
        if isinstance(tier, DiskTierConfig)
        and tier.path is not None
        and empty_store(tier.path, f"tiers[{index}]", tier.lock_timeout_s)
    ]


def _tier_bytes(config: KvtierConfig, counts, stats: dict[str, int], block_bytes: int) -> tuple[dict, dict]:
    cpu = config.tiers[0].name
    lower = [tier.name for tier in config.tiers[1:]]
    promoted = sum(stats.get(f"{name}.promoted_bytes", 0) for name in lower)
    demoted = sum(stats.get(f"{name}.demoted_bytes", 0) for name in lower)
    loaded_from_cpu = (counts.verified_blocks + counts.mismatched_blocks) * block_bytes
    read = {cpu: loaded_from_cpu + demoted}
    written = {cpu: counts.stored_blocks * block_bytes + promoted}
    for name in lower:
        read[name] = stats.get(f"{name}.promoted_bytes", 0)
        written[name] = stats.get(f"{name}.demoted_bytes", 0)
    return read, written


#: the manager's per-tier admission and wear figures (``manager.stats()``, ``<tier>.<name>``)
_ADMISSION_FIGURES = (
    "admitted_blocks",
    "refused_blocks",
    "bytes_written",
    "bytes_read_later",
    "write_amplification",
    "projected_life_days",
    # admit: budget (in the trace's time)
    "budget_bytes_per_s",
    "write_bytes_per_s",
    "admit_threshold",
    "projected_life_years",
    "device_written_bytes",
)


def _admission(stats: dict[str, int], tier: str) -> dict[str, int | float]:
    """The admission figures of ``tier`` that its manager reported (a ratio with nothing to
    divide by yet is absent)."""
    return {name: stats[f"{tier}.{name}"] for name in _ADMISSION_FIGURES if f"{tier}.{name}" in stats}


def miss_causes(stats: dict, tiers: list[str]) -> dict[str, Any] | None:
    """The stack's misses by cause from its ``stats()`` (None: it counts no causes): the
    totals, each tier's share of them, the foreign parts, and the sketch's size and stated
    error rate."""
    from kvtier.manager.causes import CAUSES, FOREIGN_PARTS

    if "miss_new" not in stats:
        return None
    by_tier = {
        name: {
            cause: stats[f"{name}.miss_{cause}"] for cause in CAUSES[1:] if stats.get(f"{name}.miss_{cause}")
        }
        for name in tiers
    }
    return {
        "misses": stats.get("misses", 0),
        "causes": {cause: stats[f"miss_{cause}"] for cause in CAUSES},
        "by_tier": {name: found for name, found in by_tier.items() if found},
        "foreign": {part: stats.get(f"foreign_{part}", 0) for part in FOREIGN_PARTS},
        "sketch": {
            "keys": stats["sketch_keys"],
            "bytes": stats["sketch_bytes"],
            "error_rate": stats["sketch_error_rate"],
            "forgotten": stats["sketch_forgotten"],
        },
    }


def _print_causes(causes: dict[str, Any], out: TextIO) -> None:
    """The misses-by-cause table under the tier table."""
    total = causes["misses"]
    rows = []
    for cause, count in causes["causes"].items():
        tiers = ", ".join(
            f"{name} {found[cause]}" for name, found in causes["by_tier"].items() if found.get(cause)
        )
        if cause == "foreign":
            parts = ", ".join(f"{part} {n}" for part, n in causes["foreign"].items() if n)
            tiers = "; ".join(text for text in (tiers, parts and f"differs: {parts}") if text)
        rows.append(
            {"cause": cause, "misses": count, "share": count / total if total else 0.0, "where": tiers}
        )
    sketch = causes["sketch"]
    print(
        f"misses by cause (every block no tier served; those after a request's first miss, "
        f"never looked up, are 'behind' where a tier held them): {total}; "
        f"sketch of {sketch['keys']} keys in {sketch['bytes']} bytes, error rate "
        f"{sketch['error_rate']:.1e}, {sketch['forgotten']} forgotten",
        file=out,
    )
    print_table(rows, ["cause", "misses", "share", "where"], out)


def replay(
    trace: str | None = None,
    config: str | None = None,
    *,
    gpu_blocks: int = DEFAULT_GPU_BLOCKS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    limit: int | None = None,
    baseline: bool = True,
    progress: bool = True,
    plot: str | None = None,
    disk_kind: str = "lmdb",
    out: TextIO | None = None,
    device: str = "cpu",
    json_line: bool = False,
    deterministic: bool = False,
    time_model: Any = None,
    arrival_scale: float = 1.0,
    codec: str | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Replay ``trace`` (default: the bundled one) through ``config`` (default: CPU + disk in a
    temporary folder); print a summary and a table (and, with ``json_line``, one JSON line);
    return the JSON record.

    ``codec``: every lower tier that takes one stores blocks with it (:mod:`kvtier.codecs`),
    in the bytes the configuration gives it: the record's ``tier_blocks`` says how many blocks
    each tier holds then, and how many it would without. With a codec anywhere in the stack
    the replayed blocks are bf16 values (a lossy codec reads them as such), and a block a
    lossy codec brought back is verified against that codec's decode of what was stored
    (``codec_verified_blocks``): its own, never another block's.

    With ``baseline``, the same trace also runs through the CPU tier alone, in the same run,
    so the JSON shows what the lower tiers add (``cpu_only_hit_ratio``). ``device``: where
    the simulated GPU cache lives, ``cpu`` (CPU tensors stand in), ``cuda`` (the real CUDA
    copy path) or ``auto`` (cuda if available); ``KvtierError`` if cuda is asked for and absent.
    ``deterministic``: every step waits for its copies and tier jobs (see
    :meth:`~kvtier.replay.engine.ReplayEngine.step`), so every figure but the times repeats
    exactly from run to run: for comparing policies or stacks tier by tier.

    A request with more blocks than ``gpu_blocks`` could never be served whole by the
    simulated engine: such requests are found before the replay starts, reported, counted
    (``skipped_requests``, ``skipped_block_refs``) and left out; the ceiling is that of the
    requests replayed. If none is left, :class:`KvtierError` says which ``--gpu-blocks`` fits.

    A lower tier that opens holding blocks (a persistent store of an earlier run) is warned
    about on stderr: its hits are not the trace's alone. ``fresh`` empties the configuration's
    disk stores first (kvtier's own stores only; a shared server is never emptied).
    """
    out = out or sys.stdout
    device = resolve_device(device)
    if gpu_blocks < 1:
        raise KvtierError(f"--gpu-blocks must be at least 1 (got {gpu_blocks}): the engine needs a GPU cache")
    requests = load_trace(trace or bundled_trace_path(), limit)
    requests, skipped = _fitting(requests, gpu_blocks)
    ceiling, refs = ceiling_hit_ratio(requests)
    with contextlib.ExitStack() as stack:
        if config is None:
            directory = stack.enter_context(scratch_directory("replay-"))
            parsed = load_config(default_config(directory, block_bytes, disk_kind))
        else:
            parsed = in_trace_blocks(load_config(config))
        if codec is not None:
            parsed = with_codec(parsed, codec)
        if fresh:
            for path in empty_stores(parsed):
                print(f"kvtier replay: --fresh: emptied the store at {path}", file=sys.stderr)
        cost = _cost_model(time_model, parsed) if time_model is not None else None  # bad input fails first
        counts, stats, elapsed = _run_one(
            parsed, requests, gpu_blocks, block_bytes, progress, "replay", device, deterministic
        )
        cpu_only = None
        if baseline and len(parsed.tiers) > 1:
            cpu_only, _, _ = _run_one(
                _cpu_only(parsed),
                requests,
                gpu_blocks,
                block_bytes,
                progress,
                "cpu only",
                device,
                deterministic,
            )
    skipped_refs = sum(len(request.hash_ids) for request in skipped)

    lower = [tier.name for tier in parsed.tiers[1:]]
    read, written = _tier_bytes(parsed, counts, stats, block_bytes)
    hit_blocks = sum(counts.hits.values())
    record: dict[str, Any] = {
        "requests": counts.requests,
        "deterministic": deterministic,
        "block_refs": counts.block_refs,
        "ceiling_hit_ratio": ceiling,
        "hit_ratio": hit_blocks / counts.block_refs if counts.block_refs else 0.0,
        "hits": counts.hits,
        "bytes_read": read,
        "bytes_written": written,
        "promotions": sum(stats.get(f"{name}.promotions", 0) for name in lower),
        "demotions": sum(stats.get(f"{name}.demotions", 0) for name in lower),
        "dropped_blocks": counts.dropped_blocks,
        "verified_blocks": counts.verified_blocks,
        "codec_verified_blocks": counts.codec_verified_blocks,
        "mismatched_blocks": counts.mismatched_blocks,
        "corrupt_blocks": counts.mismatched_blocks
        + sum(stats.get(f"{name}.corrupt_blocks", 0) for name in lower),
        "computed_blocks": counts.computed_blocks,
        "stored_blocks": counts.stored_blocks,
        "refused_stores": counts.refused_stores,
        "store_waits": counts.store_waits,
        "failed_transfers": counts.failed_transfers,
        "steps": counts.steps,
        "elapsed_s": elapsed,
        "engine_s": counts.engine_s,
        # the worker's copies between the GPU cache and the CPU tier, as its engine timed them
        "copies": {
            direction: {
                **figures,
                "gbps": figures["bytes"] / figures["seconds"] / 1e9 if figures["seconds"] else 0.0,
            }
            for direction, figures in counts.copies.items()
        },
        # not in elapsed_s: closing the stack, which saves what only the CPU tier holds
        "shutdown_s": counts.shutdown_s,
        # not in bytes_written: what that save wrote to each lower tier
        "shutdown_bytes_written": counts.shutdown_bytes_written,
        "stack_s": elapsed - counts.engine_s,
        "blocks_per_s": counts.block_refs / elapsed if elapsed else 0.0,
        "skipped_requests": len(skipped),
        "skipped_block_refs": skipped_refs,
        "gpu_blocks": gpu_blocks,
        "block_bytes": block_bytes,
        "device": device,
        "tiers": [f"{tier.name}:{tier.kind}" for tier in parsed.tiers],
        # per lower tier: what its admission let through and what the writes bought
        "admission": {name: _admission(stats, name) for name in lower},
        # per lower tier: its codec and the blocks its bytes hold with it (and without)
        "tier_blocks": _held(parsed, stats, block_bytes),
    }
    causes = miss_causes(stats, [tier.name for tier in parsed.tiers])
    if causes is not None:
        # each block no tier served (a lookup that missed, a read from below that failed, a
        # block behind a request's first miss) under its one cause
        record["miss_causes"] = causes
    if cpu_only is not None:
        record["cpu_only_hit_ratio"] = sum(cpu_only.hits.values()) / cpu_only.block_refs
    if cost is not None:
        from kvtier.replay.ttft import time_record

        cpu_served = cpu_only.served if cpu_only is not None else None
        record["time"] = time_record(cost, requests, counts.served, gpu_blocks, arrival_scale, cpu_served)
    assert refs == counts.block_refs  # the engine saw every reference of the trace

    rows = [
        {
            "tier": name,
            "hits": hits,
            "hit_ratio": hits / counts.block_refs if counts.block_refs else 0.0,
            "bytes_read": read.get(name),
            "bytes_written": written.get(name),
        }
        for name, hits in counts.hits.items()
    ]
    print(
        f"kvtier replay: {counts.requests} requests, {counts.block_refs} block refs; hit ratio "
        f"{record['hit_ratio']:.4f} of a {ceiling:.4f} ceiling"
        + (f"; CPU tier alone {record['cpu_only_hit_ratio']:.4f}" if cpu_only is not None else ""),
        file=out,
    )
    print(  # what elapsed_s is: ReplayEngine.run, from the first request to the last store
        f"replayed in {elapsed:.1f} s ({record['blocks_per_s']:.0f} blocks/s): the stack and the simulated "
        f"engine serving every request, to its last store ({counts.engine_s:.1f} s of it the engine's own "
        f"work: making and checking payloads); not the trace load, opening the stack, closing it "
        f"({counts.shutdown_s:.1f} s), nor the CPU-tier-only run",
        file=out,
    )
    print_table(rows, ["tier", "hits", "hit_ratio", "bytes_read", "bytes_written"], out)
    print(HIT_RATIO_MEANS, file=out)
    _print_checks(record, out)
    _print_admission(record["admission"], out)
    _print_held(record["tier_blocks"], counts.codec_verified_blocks, out)
    if causes is not None:
        _print_causes(causes, out)
    if "time" in record:
        from kvtier.replay.ttft import print_time

        print_time(record["time"], out)
    if plot:
        _plot(counts, plot, _ceiling_timeline(requests, counts.timeline), cpu_only)
    if json_line:
        print_json(record, out)
    return record


#: what a replay's ``hit_ratio`` divides, printed under its table
HIT_RATIO_MEANS = (
    "hit ratio = block refs served by any tier, the GPU cache included / every block ref of the "
    "trace (kvtier stats counts kvtier's tiers only: their hits / the blocks asked of them)"
)


def _print_checks(record: dict[str, Any], out: TextIO) -> None:
    """What the replay checked: loads verified, wrong bytes, corrupt blocks, blocks dropped."""
    print(
        f"loads: {record['verified_blocks']} verified byte for byte, "
        f"{record['mismatched_blocks']} served wrong bytes (exit 1 if any); "
        f"{record['corrupt_blocks']} corrupt (caught by a check, served as a miss); "
        f"{record['dropped_blocks']} blocks dropped from the CPU tier that no lower tier held",
        file=out,
    )


def _print_admission(admission: dict[str, dict[str, Any]], out: TextIO) -> None:
    """One line per lower tier that counts admission: what it took and refused, what the
    writes bought, and under ``admit: budget`` the budget's figures."""
    from kvtier.config.units import format_size

    def size(value: float) -> str:
        return format_size(int(value))

    for name, figures in admission.items():
        if not figures:
            continue
        parts = [
            f"admitted {figures.get('admitted_blocks', 0)} blocks, refused {figures.get('refused_blocks', 0)}"
        ]
        if "bytes_written" in figures:
            parts.append(
                f"wrote {size(figures['bytes_written'])}, read back {size(figures.get('bytes_read_later', 0))}"
                + (
                    f" (write amplification {figures['write_amplification']:.3f})"
                    if "write_amplification" in figures
                    else ""
                )
            )
        if "budget_bytes_per_s" in figures:
            parts.append(
                f"writing {size(figures.get('write_bytes_per_s', 0))}/s of a "
                f"{size(figures['budget_bytes_per_s'])}/s budget (trace time), admit threshold "
                f"{figures.get('admit_threshold', 0):.2f}"
            )
        if "device_written_bytes" in figures:
            parts.append(f"the drive wrote {size(figures['device_written_bytes'])}")
        if "projected_life_years" in figures:
            parts.append(f"projected drive life {figures['projected_life_years']:.1f} years")
        elif "projected_life_days" in figures:
            parts.append(f"projected drive life {figures['projected_life_days']:.0f} days")
        print(f"tier {name}: " + "; ".join(parts), file=out)


def _print_held(held: dict[str, dict[str, Any]], codec_verified: int, out: TextIO) -> None:
    """One line per lower tier with a codec: the blocks it holds, and without the codec."""
    for name, tier in held.items():
        if tier["codec"] == "none":
            continue
        ratio = (
            f"{tier['codec_ratio']:.2f}x on the blocks it wrote" if tier["codec_ratio"] else "nothing written"
        )
        without = (
            f", {tier['raw_capacity_blocks']} without it" if tier["raw_capacity_blocks"] is not None else ""
        )
        print(
            f"tier {name}: codec {tier['codec']} ({ratio}): room for {tier['capacity_blocks']} blocks"
            f"{without}; {codec_verified} loaded blocks equal their own decode",
            file=out,
        )


def _cost_model(time_model: Any, config: KvtierConfig) -> Any:
    """The :class:`~kvtier.costs.CostModel` of ``time_model`` over ``config``'s tiers."""
    from kvtier.costs.timing import CostModel, tier_speeds

    model, gpu, measured = time_model
    speeds = tier_speeds([(tier.name, tier.kind) for tier in config.tiers], gpu, measured, _codecs(config))
    return CostModel(model, gpu, {speed.name: speed for speed in speeds})


def _fitting(requests: list, gpu_blocks: int) -> tuple[list, list]:
    """The requests the simulated GPU cache can hold whole, and the others (reported)."""
    fit = [request for request in requests if len(request.hash_ids) <= gpu_blocks]
    if len(fit) == len(requests):
        return requests, []
    skipped = [request for request in requests if len(request.hash_ids) > gpu_blocks]
    largest = max(len(request.hash_ids) for request in skipped)
    if not fit:
        raise KvtierError(
            f"every request needs more than --gpu-blocks {gpu_blocks} GPU blocks (the largest "
            f"{largest}): raise --gpu-blocks to at least {largest}"
        )
    print(
        f"kvtier replay: skipping {len(skipped)} of {len(requests)} requests with more blocks than "
        f"--gpu-blocks {gpu_blocks} (the largest has {largest}); raise --gpu-blocks to at least "
        f"{largest} to replay them",
        file=sys.stderr,  # seen with --json too, where stdout carries only the JSON line
    )
    return fit, skipped


def _ceiling_timeline(requests, timeline) -> list[float]:
    """The unbounded cache's cumulative hit ratio at each sample of ``timeline``."""
    marks = {done for done, _, _ in timeline}
    seen: set[int] = set()
    hits = refs = 0
    ratios: dict[int, float] = {}
    for done, request in enumerate(requests, start=1):
        refs += len(request.hash_ids)
        for block_id in request.hash_ids:
            if block_id not in seen:
                break
            hits += 1
        seen.update(request.hash_ids)
        if done in marks:
            ratios[done] = hits / refs if refs else 0.0
    return [ratios.get(done, 0.0) for done, _, _ in timeline]


def _plot(counts, path: str, ceiling: list[float], cpu_only=None) -> None:
    plt = pyplot("--plot")
    xs = [requests for requests, _, _ in counts.timeline]
    with_causes = len(counts.cause_timeline) == len(counts.timeline) and counts.cause_timeline
    below = None
    if with_causes:
        figure, (axes, below) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    else:
        figure, axes = plt.subplots(figsize=(8, 4.5))
    for name in counts.hits:
        ys = [hits[name] / refs if refs else 0.0 for _, hits, refs in counts.timeline]
        axes.plot(xs, ys, label=name)
    total = [sum(hits.values()) / refs if refs else 0.0 for _, hits, refs in counts.timeline]
    axes.plot(xs, total, label="all tiers", color="black", linewidth=2)
    axes.plot(xs, ceiling, label="ceiling (unbounded cache)", color="grey", linestyle="--")
    if cpu_only is not None:
        alone = [sum(hits.values()) / refs if refs else 0.0 for _, hits, refs in cpu_only.timeline]
        axes.plot(
            [done for done, _, _ in cpu_only.timeline],
            alone,
            label="CPU tier alone",
            color="black",
            linestyle=":",
        )
    axes.set_xlabel("requests replayed")
    axes.set_ylabel("cumulative hit ratio (of block refs)")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title("kvtier replay: hits per tier")
    if below is not None:
        _plot_causes(below, xs, counts.cause_timeline)
    figure.tight_layout()
    save_figure(plt, figure, path, "--plot", dpi=120)


def _plot_causes(axes, xs: list[int], timeline: list[dict[str, int]]) -> None:
    """Cumulative misses by cause, stacked (the causes no miss had are left out)."""
    causes = [cause for cause in timeline[-1] if timeline[-1][cause]]
    if causes:
        axes.stackplot(xs, [[sample.get(cause, 0) for sample in timeline] for cause in causes], labels=causes)
        axes.legend(loc="upper left")
    axes.set_xlabel("requests replayed")
    axes.set_ylabel("misses (cumulative)")
    axes.grid(alpha=0.3)
    axes.set_title("kvtier replay: misses by cause")

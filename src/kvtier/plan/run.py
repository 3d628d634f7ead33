"""``kvtier plan``: simulate a trace at many cache sizes, print the table, recommend tier sizes."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvtier.bench.report import print_table, progress_bar, pyplot, save_figure
from kvtier.cli.signals import deferred_stop
from kvtier.config.units import format_size
from kvtier.errors import ConfigError
from kvtier.plan.admission import simulate_admission
from kvtier.plan.belady import belady
from kvtier.plan.oracle import reuse_oracle
from kvtier.plan.signals import SIGNALS, reuse_signals
from kvtier.plan.simulate import simulate
from kvtier.plan.stack import PER_BLOCK, check_writable, tier_capacities, write_stack
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies import get_policy_class, registered_policies
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, bundled_trace_path, ceiling_hit_ratio, load_trace

__all__ = ["DEFAULT_CAPACITIES", "plan", "smallest_reaching"]

#: cache sizes (blocks) simulated when none are given: a geometric sweep
DEFAULT_CAPACITIES = (500, 1000, 2000, 5000, 10000, 20000, 50000)
#: payload bytes per block when none is given: 512 tokens of Llama-3-8B in fp16
#: (32 layers x 2 (K and V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token)
DEFAULT_BLOCK_BYTES = 512 * 128 * 1024


def smallest_reaching(capacities: Sequence[int], ratios: Sequence[float], goal: float) -> int | None:
    """The smallest of ``capacities`` whose ratio reaches ``goal``; ``None`` if none does."""
    reaching = [c for c, r in zip(capacities, ratios) if r >= goal]
    return min(reaching) if reaching else None


def _check(
    capacities: Sequence[int],
    policies: Sequence[str],
    target: float,
    cpu_target: float,
    admission_policy: str,
) -> None:
    get_policy_class(admission_policy, field="--admission-policy")
    if not capacities or any(c < 1 for c in capacities):
        raise ConfigError(
            "--capacities",
            list(capacities),
            "one or more positive block counts",
            "give sizes in blocks, e.g. --capacities 1000 5000 20000",
        )
    for name in policies:
        get_policy_class(name, field="--policies")  # names the choices if unknown
    for flag, value in (("--target", target), ("--cpu-target", cpu_target)):
        if not 0 < value <= 1:
            raise ConfigError(flag, value, "a share of the ceiling in (0, 1]", "e.g. 0.95")


def plan(
    trace: str | Path | None = None,
    capacities: Sequence[int] = DEFAULT_CAPACITIES,
    policies: Sequence[str] | None = None,
    target: float = 0.95,
    cpu_target: float = 0.5,
    block_bytes: int | None = None,
    plot: str | None = None,
    out: TextIO | None = None,
    admission_policy: str = "lru",
    min_reuse: int = 2,
    signals: bool = False,
    jobs: int = 1,
    prices: str | None = None,
    time_model: Any = None,
    cost_target: float = 0.9,
    gpu_blocks: int = 2000,
    money_plot: str | None = None,
    codec: str | None = None,
    progress: bool = True,
    write_config: str | None = None,
) -> dict[str, Any]:
    """Hit ratio per policy and size, Belady's bound, the ceiling, and tier sizes; the JSON record.

    Each policy is the class the managers use (from the policy registry), driven through
    :func:`~kvtier.plan.simulate.simulate`. Two bounds say what is left to gain:
    ``reuse_oracle`` is the best of the simulated policies each told which blocks are never
    referenced again (:mod:`kvtier.plan.oracle`: a perfect reuse predictor that knows
    nothing of *when*; the best, because the order among the blocks that do come back still
    matters at small sizes, and telling one policy can even cost it a little there), and
    ``admission`` compares, with a CPU tier of each size ordered by ``admission_policy`` over
    a disk larger than the trace (:mod:`kvtier.plan.admission`), the disk writes an oracle
    admission could skip without losing a hit with what ``admit: reuse`` at ``min_reuse``
    skips and loses. ``signals`` adds :func:`~kvtier.plan.signals.reuse_signals`: how well
    what a policy knows at store time predicts reuse. Recommendations use the best policy at each size:
    the disk tier (which holds everything the stack keeps) is the smallest size reaching
    ``target`` of the ceiling; the CPU tier is the smallest reaching ``cpu_target`` of it (the
    hot part, served without a disk read). ``None`` means no simulated size reaches it:
    simulate larger ones.

    Every simulation (a policy, its oracle, Belady or the admission pair, at one size) is
    independent of the others: ``jobs`` > 1 runs them in that many worker processes, each
    given the trace once. The record is the same either way but for ``wall_s``: each
    simulation times itself in CPU seconds of the process that ran it (``refs_per_s``). The
    workers are spawned, not forked, so they import each policy by its class path: a
    policy class defined in ``__main__`` or inside a function needs ``jobs=1``.

    ``prices`` (a prices file, :mod:`kvtier.costs.prices`) with ``time_model`` (``(model, gpu,
    measured speeds)``) adds ``money`` (:func:`~kvtier.plan.money.money_plan`): GPU-seconds saved
    per dollar for each combination of DRAM, NVMe and shared tier sizes among ``capacities``, by
    the best online policy and by Belady, behind a GPU cache of ``gpu_blocks``; it recommends
    the cheapest within ``cost_target`` of the largest saving. ``money_plot`` draws it.
    ``time_model`` without ``prices`` adds ``break_even`` only (per kind of tier it prices).

    ``codec`` (a :mod:`kvtier.codecs` name) adds ``codec``: at each size's bytes on a disk tier,
    how many blocks of bf16 KV the tier holds with the codec (its slots sized for the encoded
    block), and the hit ratio the best policy at that size reaches with them; and the disk
    tier it recommends for ``target`` then.

    ``block_bytes`` (the sizes in bytes) is, with ``time_model``, its model's KV of a trace
    block (512 tokens), else :data:`DEFAULT_BLOCK_BYTES`. ``progress``: a bar counting the
    simulations on a terminal's stderr. ``write_config`` (a path) writes the advised stack
    there as kvtier YAML (:mod:`kvtier.plan.stack`).
    """
    started = time.perf_counter()
    policies = list(policies or registered_policies())
    capacities = sorted(set(capacities))
    _check(capacities, policies, target, cpu_target, admission_policy)
    AdmissionFilter("reuse", min_reuse)  # a bad min_reuse fails here, named
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError("--jobs", jobs, "a positive number of processes", "e.g. --jobs 2")
    money_inputs = _money_inputs(prices, time_model, cost_target, gpu_blocks)  # bad input fails first
    block_bytes, block_note = _block_bytes(block_bytes, time_model)
    if write_config is not None:
        check_writable(write_config)
    slots = _codec_slots(codec, block_bytes) if codec is not None else None
    path = Path(trace) if trace else bundled_trace_path()
    requests = load_trace(path)
    chains = [request.hash_ids for request in requests]
    ceiling, refs = ceiling_hit_ratio(requests)

    classes = {name: _class_path(get_policy_class(name, field="--policies")) for name in policies}
    admitting = _class_path(get_policy_class(admission_policy, field="--admission-policy"))
    # A cache of at least the trace's distinct blocks never evicts, so it gives what one of
    # exactly that many gives: simulated at that size (a capacity of 10^15 blocks would
    # otherwise be allocated slot by slot).
    distinct = max(1, len({block for chain in chains for block in chain}))
    sized = {c: min(c, distinct) for c in capacities}
    tasks: list[tuple[str, str | None, int]] = []
    for name in policies:
        tasks += [("policy", classes[name], sized[c]) for c in capacities]
        tasks += [("oracle", classes[name], sized[c]) for c in capacities]
    tasks += [("belady", None, sized[c]) for c in capacities]
    tasks += [("admission", admitting, sized[c]) for c in capacities]
    tasks = list(dict.fromkeys(tasks))
    ran = dict(zip(tasks, _run_all(tasks, chains, path, min_reuse, jobs, progress)))
    done = {(kind, path, c): ran[kind, path, sized[c]] for kind, path, _ in tasks for c in capacities}

    hit_ratio: dict[str, list[float]] = {}
    told: dict[str, list[float]] = {}  # policy -> its reuse-oracle hit ratio per capacity
    seconds: dict[str, float] = {}
    learnt: dict[str, list[dict[str, float]]] = {}  # policy -> what it learnt, per capacity
    misses: dict[str, list[dict[str, int]]] = {}  # policy -> missed refs by cause, per capacity
    for name in policies:
        results = [done["policy", classes[name], c] for c in capacities]
        hit_ratio[name] = [ratio for ratio, _, _, _ in results]
        seconds[name] = sum(spent for _, spent, _, _ in results)
        if any(described for _, _, described, _ in results):
            learnt[name] = [described for _, _, described, _ in results]
        misses[name] = [causes for _, _, _, causes in results]
        told[name] = [done["oracle", classes[name], c] for c in capacities]
    opt = [done["belady", None, c][0] for c in capacities]
    opt_s = sum(done["belady", None, c][1] for c in capacities)
    oracle_policy = [max(policies, key=lambda name: told[name][i]) for i in range(len(capacities))]
    reuse_bound = [told[name][i] for i, name in enumerate(oracle_policy)]
    rows = [done["admission", admitting, c] for c in capacities]
    admission = {
        "cpu_policy": admission_policy,
        "min_reuse": min_reuse,
        **{key: [row[key] for row in rows] for key in _ADMISSION_KEYS},
    }

    best = [max(hit_ratio[name][i] for name in policies) for i in range(len(capacities))]
    best_policy = [max(policies, key=lambda name: hit_ratio[name][i]) for i in range(len(capacities))]
    disk_blocks = smallest_reaching(capacities, best, target * ceiling)
    cpu_blocks = smallest_reaching(capacities, best, cpu_target * ceiling)
    sim_refs = refs * len(capacities)
    record: dict[str, Any] = {
        "bench": "plan",
        "trace": str(path),
        "requests": len(chains),
        "block_refs": refs,
        "capacities": capacities,
        "hit_ratio": hit_ratio,
        "opt": opt,
        "ceiling": round(ceiling, 4),
        "best_policy": best_policy,
        "target": target,
        "cpu_target": cpu_target,
        "block_bytes": block_bytes,
        "recommend": {
            "cpu_blocks": cpu_blocks,
            "cpu_bytes": None if cpu_blocks is None else cpu_blocks * block_bytes,
            "disk_blocks": disk_blocks,
            "disk_bytes": None if disk_blocks is None else disk_blocks * block_bytes,
            # what a stack's tiers need as capacity: a disk tier's also counts each block's header
            **tier_capacities(block_bytes, cpu_blocks, disk_blocks),
        },
        "refs_per_s": {name: round(sim_refs / max(seconds[name], 1e-9)) for name in policies},
        "opt_refs_per_s": round(sim_refs / max(opt_s, 1e-9)),
        "reuse_oracle": reuse_bound,
        "reuse_oracle_policy": oracle_policy,
        "admission": admission,
        "learnt": learnt,
        # per policy, per capacity: the missed block refs (refs - hits) by cause: new (never
        # stored before), evicted (stored, then let go), behind (present, after a miss)
        "misses": misses,
        "jobs": jobs,
    }
    if slots is not None:
        raw_slot, codec_slot = slots
        held = [c * raw_slot // codec_slot for c in capacities]
        more: list[tuple[str, str | None, int]] = [
            ("policy", classes[name], min(c, distinct)) for name, c in zip(best_policy, held)
        ]
        ratios = [result[0] for result in _run_all(more, chains, path, min_reuse, jobs, progress)]
        reached = smallest_reaching(capacities, ratios, target * ceiling)
        record["codec"] = {
            "name": codec,
            "blocks_per_byte_ratio": raw_slot / codec_slot,
            "blocks": held,
            "hit_ratio": ratios,
            "policy": best_policy,
            "disk_blocks": None if reached is None else reached * raw_slot // codec_slot,
            "disk_bytes": None if reached is None else reached * block_bytes,
        }
    if signals:
        record["signals"] = reuse_signals(chains)
    if money_inputs is not None:
        from kvtier.plan.money import money_plan
        from kvtier.replay.ttft import gpu_only_served

        cost, priced = money_inputs
        gpu_hits = sum(served.get("gpu", 0) for served in gpu_only_served(requests, gpu_blocks))
        record["money"] = money_plan(cost, priced, requests, capacities, best, opt, gpu_hits, cost_target)
        record["money"]["gpu_blocks"] = gpu_blocks
    elif time_model is not None:  # --model alone: the break-even against each kind of tier
        from kvtier.plan.money import stack_cost

        mean_prompt = round(sum(r.input_length for r in requests) / len(requests)) if requests else 512
        record["break_even"] = stack_cost(*time_model).break_even(mean_prompt)
    record["wall_s"] = round(time.perf_counter() - started, 2)
    if out is not None:
        _print(record, policies, block_note, out)
    if write_config is not None:
        write_stack(record, block_note, write_config)
        if out is not None:
            print(
                f"the advised stack written to {write_config}: kvtier config check {write_config}", file=out
            )
    if plot:
        _plot(record, policies, plot)
    if money_plot and "money" in record:
        from kvtier.plan.money import plot_money

        plot_money(record["money"], money_plot)
    return record


def _codec_slots(codec: str, block_bytes: int) -> tuple[int, int]:
    """The bytes a disk tier spends per block without and with ``codec`` (bf16 KV), or
    :class:`ConfigError` naming ``--codec``."""
    from kvtier.codecs import make_codec, parse_codec_option
    from kvtier.costs.bandwidth import codec_cost
    from kvtier.tiers.disk.format import on_disk_block_bytes

    parse_codec_option({"codec": codec}, "--codec")
    made = make_codec(codec, block_bytes, "bfloat16", "--codec")
    stored = made.max_encoded_bytes if made is not None else block_bytes
    if made is not None and not made.fixed_size:  # varying sizes: a files tier counts pages
        stored = math.ceil(block_bytes / codec_cost(codec).ratio)  # at the ratio measured on KV
    return on_disk_block_bytes(block_bytes), on_disk_block_bytes(stored)


def _block_bytes(block_bytes: int | None, time_model: Any) -> tuple[int, str]:
    """The bytes of a block, and where they come from (said beside the sizes)."""
    if block_bytes is not None and (isinstance(block_bytes, bool) or block_bytes < 1):
        raise ConfigError(
            "--block-bytes", block_bytes, "a positive number of bytes", "e.g. --block-bytes 65536"
        )
    if time_model is None:
        if block_bytes is None:
            return (
                DEFAULT_BLOCK_BYTES,
                f"the default, {TRACE_BLOCK_TOKENS} tokens of Llama-3-8B fp16: --model sets it",
            )
        return block_bytes, "--block-bytes"
    from kvtier.plan.money import block_bytes as model_block_bytes

    model = time_model[0]
    derived = model_block_bytes(model)
    where = f"{TRACE_BLOCK_TOKENS} tokens x {model.kv_bytes_per_token} KV bytes/token of {model.name}"
    if block_bytes not in (None, derived):
        raise ConfigError(
            "--block-bytes", block_bytes, f"{derived} with --model: {where}", "drop --block-bytes"
        )
    return derived, where


def _money_inputs(prices: str | None, time_model: Any, target: float, gpu_blocks: int) -> Any:
    """``(cost model, prices)`` for ``--prices``, checked before any simulation; ``None`` without."""
    if prices is None:
        return None
    if time_model is None:
        raise ConfigError("--prices", prices, "used with --model", "add --model NAME (e.g. Llama-3.1-8B)")
    if not 0 < target <= 1:
        raise ConfigError("--cost-target", target, "a share of the best saving in (0, 1]", "e.g. 0.9")
    if gpu_blocks < 1:
        raise ConfigError("--gpu-blocks", gpu_blocks, "a positive number of blocks", "e.g. 2000")
    from kvtier.costs.prices import load_prices
    from kvtier.plan.money import stack_cost

    return stack_cost(*time_model), load_prices(prices)


#: the admission table's rows, one value per CPU size each
_ADMISSION_KEYS = (
    "writes_all",
    "reads_all",
    "hit_ratio_all",
    "oracle_refusable",
    "writes_reuse",
    "reuse_writes_cut",
    "hit_ratio_reuse",
    "reuse_hit_loss",
)


def _class_path(cls: type) -> str:
    """``module:Class`` for ``cls``: how a worker process finds the same class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _simulate_task(task: tuple[str, str | None, int], chains: Sequence[Sequence[int]], min_reuse: int) -> Any:
    """One of :func:`plan`'s simulations: ``(kind, policy class path, capacity)``."""
    kind, target, capacity = task
    if kind == "belady":
        result = belady(chains, capacity)
        return round(result.hit_ratio, 4), result.seconds
    assert target is not None  # every other kind names its policy
    cls = get_policy_class(target, field="--policies")
    if kind == "policy":
        policy = cls(capacity)
        result = simulate(chains, policy, capacity, causes=True)
        return round(result.hit_ratio, 4), result.seconds, policy.describe(), result.misses
    if kind == "oracle":
        return round(reuse_oracle(chains, cls, capacity).hit_ratio, 4)
    return _admission_row(chains, cls, capacity, min_reuse)


def _admission_row(
    chains: Sequence[Sequence[int]], cls: type, capacity: int, min_reuse: int
) -> dict[str, Any]:
    """For a CPU tier of ``capacity`` blocks: disk writes with ``admit: all``, the share of them
    an oracle could refuse at no loss, and what ``admit: reuse`` cuts and costs."""
    every = simulate_admission(chains, cls(capacity), capacity)
    reuse = simulate_admission(chains, cls(capacity), capacity, AdmissionFilter("reuse", min_reuse))
    return {
        "writes_all": every.writes,
        "reads_all": every.reads,
        "hit_ratio_all": round(every.hit_ratio, 4),
        "oracle_refusable": round(every.needless_writes / every.writes, 4) if every.writes else 0.0,
        "writes_reuse": reuse.writes,
        "reuse_writes_cut": round(1 - reuse.writes / every.writes, 4) if every.writes else 0.0,
        "hit_ratio_reuse": round(reuse.hit_ratio, 4),
        "reuse_hit_loss": round(1 - reuse.hit_ratio / every.hit_ratio, 4) if every.hit_ratio else 0.0,
    }


# A worker process's copy of the trace and settings, set once by _start_worker.
_WORKER: dict[str, Any] = {}


def _start_worker(trace: Path, min_reuse: int) -> None:
    # The path, not the chains: a worker's start then writes a few bytes to its pipe, where
    # megabytes would keep the parent writing (a SIGTERM then would cut the pickle short)
    _WORKER.update(chains=[request.hash_ids for request in load_trace(trace)], min_reuse=min_reuse)


def _worker_task(task: tuple[str, str | None, int]) -> Any:
    return _simulate_task(task, _WORKER["chains"], _WORKER["min_reuse"])


def _run_all(
    tasks: list[tuple[str, str | None, int]],
    chains: Sequence[Sequence[int]],
    trace: Path,
    min_reuse: int,
    jobs: int,
    progress: bool,
) -> list[Any]:
    """Each task's result, in order: here, or in ``jobs`` spawned worker processes (which
    read the ``chains`` again from ``trace``); a bar counting them with ``progress``."""
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(progress_bar(len(tasks), "plan", progress, unit="sim"))
        if jobs == 1 or len(tasks) == 1:
            results = []
            for task in tasks:
                results.append(_simulate_task(task, chains, min_reuse))
                bar.update(1)
            return results
        # multiprocessing's Pool rather than concurrent.futures': leaving its `with` terminates
        # the workers, so SIGTERM or Ctrl-C ends a plan at once, where the executor's exit would
        # run every simulation still queued first (minutes).
        context = multiprocessing.get_context("spawn")
        with deferred_stop():  # never a worker spawned and left without its data
            pool = stack.enter_context(
                context.Pool(min(jobs, len(tasks)), initializer=_start_worker, initargs=(trace, min_reuse))
            )
        # Handed out slowest first (Belady's heap, then the oracles, then the policies), so
        # the last task to finish is a short one and no worker idles long at the end.
        by_cost = sorted(tasks, key=lambda task: (_COST[task[0]], task[2]), reverse=True)
        # the bar counts in the pool's result thread, as each simulation finishes
        pending = {
            task: pool.apply_async(_worker_task, (task,), callback=lambda _: bar.update(1))
            for task in by_cost
        }
        return [pending[task].get() for task in tasks]


#: rough relative cost of each kind of task, for the order they are handed out in
_COST = {"admission": 3, "belady": 2, "oracle": 1, "policy": 0}


def _print(record: dict[str, Any], policies: Sequence[str], block_note: str, out: TextIO) -> None:
    rows = []
    for i, capacity in enumerate(record["capacities"]):
        row: dict[str, Any] = {"blocks": capacity}
        row.update({name: record["hit_ratio"][name][i] for name in policies})
        row["reuse_oracle"] = record["reuse_oracle"][i]
        row["opt"] = record["opt"][i]
        row["ceiling"] = record["ceiling"]
        rows.append(row)
    print(
        f"{record['trace']}: {record['requests']} requests, {record['block_refs']} block refs "
        "(prefix hits, one pooled cache)",
        file=out,
    )
    print_table(rows, ["blocks", *policies, "reuse_oracle", "opt", "ceiling"], out)
    print("missed block refs by cause, with the best policy at each size:", file=out)
    print_table(
        [
            {"blocks": capacity, "policy": name, **record["misses"][name][i]}
            for i, (capacity, name) in enumerate(zip(record["capacities"], record["best_policy"]))
        ],
        ["blocks", "policy", "new", "evicted", "behind"],
        out,
    )
    print(
        "reuse_oracle: the best of these policies evicting first the blocks never referenced "
        f"again (knows whether, not when): {record['reuse_oracle_policy']}",
        file=out,
    )
    for name, states in record["learnt"].items():
        print(
            f"{name} at the end of the trace, per size: "
            + "; ".join(", ".join(f"{k} {v:g}" for k, v in state.items()) for state in states),
            file=out,
        )
    adm = record["admission"]
    columns = [
        "writes_all",
        "oracle_refusable",
        "writes_reuse",
        "reuse_writes_cut",
        "hit_ratio_all",
        "hit_ratio_reuse",
        "reuse_hit_loss",
    ]
    print(
        f"disk admission: CPU tier of N blocks ({adm['cpu_policy']}) over an unbounded disk; "
        f"admit: all vs an oracle vs admit: reuse, min_reuse {adm['min_reuse']}",
        file=out,
    )
    print_table(
        [
            {"cpu_blocks": capacity, **{key: adm[key][i] for key in columns}}
            for i, capacity in enumerate(record["capacities"])
        ],
        ["cpu_blocks", *columns],
        out,
    )
    if "signals" in record:
        signals = record["signals"]
        print("P(referenced again) by what is known when a block is stored:", file=out)
        print_table(
            [
                {"signal": name, "refs": signals[name]["refs"], "p_again": signals[name]["p_again"]}
                for name in ("all", *SIGNALS)
            ],
            ["signal", "refs", "p_again"],
            out,
        )
        for kind in ("reuse_distance_median", "first_reuse_distance_median"):
            print(
                f"{kind}: {signals[kind]['requests']} requests, {signals[kind]['block_refs']} block refs",
                file=out,
            )
        print("new blocks by the length of their request (blocks): P(referenced again)", file=out)
        print_table(
            [
                {
                    "request_blocks": f"{row['request_blocks'][0]}-{row['request_blocks'][1] or ''}",
                    "refs": row["refs"],
                    "p_again": row["p_again"],
                }
                for row in signals["new_by_request_blocks"]
            ],
            ["request_blocks", "refs", "p_again"],
            out,
        )
        print(
            "first reuse by age (refs since stored): chance per 1,000 refs, of blocks not reused yet",
            file=out,
        )
        print_table(
            [
                {
                    "age_refs": "-".join(map(str, row["age_refs"])),
                    "blocks": row["blocks"],
                    "p_per_1k_refs": row["p_per_1k_refs"],
                }
                for row in signals["first_reuse_by_age"]
            ],
            ["age_refs", "blocks", "p_per_1k_refs"],
            out,
        )
    rec = record["recommend"]
    print(f"blocks of {format_size(record['block_bytes'])}: {block_note}", file=out)
    for tier, share, key in (("CPU tier ", "cpu_target", "cpu"), ("disk tier", "target", "disk")):
        blocks = rec[f"{key}_blocks"]
        size = (
            "not reached: simulate larger sizes"
            if blocks is None
            else f"{blocks} blocks: capacity {format_size(rec[f'{key}_capacity_bytes'])} ({PER_BLOCK[key]})"
        )
        print(f"{tier} ({record[share]:.0%} of ceiling): {size}", file=out)
    rates = ", ".join(f"{name} {rate}" for name, rate in record["refs_per_s"].items())
    print(f"block refs simulated per CPU second: {rates}; Belady {record['opt_refs_per_s']}", file=out)
    if "codec" in record:
        _print_codec(record, out)
    if "money" in record:
        from kvtier.plan.money import print_money

        print_money(record["money"], out)
    elif "break_even" in record:
        from kvtier.replay.ttft import print_break_even

        print_break_even(record["break_even"], out)


def _print_codec(record: dict[str, Any], out: TextIO) -> None:
    """What the codec buys a disk tier at each size's bytes: blocks held, hit ratio."""
    codec = record["codec"]
    print(
        f"codec {codec['name']} on a disk tier of the same bytes (bf16 KV; {codec['blocks_per_byte_ratio']:.2f}x "
        "the blocks per byte; lossless: a files tier at the ratio measured on SmolLM2's KV, lmdb none):",
        file=out,
    )
    print_table(
        [
            {
                "bytes": format_size(capacity * record["block_bytes"]),
                "blocks": capacity,
                "hit_ratio": max(record["hit_ratio"][name][i] for name in record["hit_ratio"]),
                "codec_blocks": codec["blocks"][i],
                "codec_hit_ratio": codec["hit_ratio"][i],
            }
            for i, capacity in enumerate(record["capacities"])
        ],
        ["bytes", "blocks", "hit_ratio", "codec_blocks", "codec_hit_ratio"],
        out,
    )
    blocks = codec["disk_blocks"]
    size = "not reached" if blocks is None else f"{blocks} blocks, {format_size(codec['disk_bytes'])}"
    print(f"disk tier with {codec['name']} ({record['target']:.0%} of ceiling): {size}", file=out)


def _plot(record: dict[str, Any], policies: Sequence[str], path: str) -> None:
    plt = pyplot("--plot")
    xs = record["capacities"]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name in policies:
        axes.plot(xs, record["hit_ratio"][name], marker="o", label=name)
    axes.plot(
        xs,
        record["reuse_oracle"],
        marker="o",
        color="dimgrey",
        linestyle=":",
        label="reuse oracle (knows which blocks come back)",
    )
    axes.plot(xs, record["opt"], marker="o", color="black", label="Belady (offline optimum)")
    axes.axhline(record["ceiling"], color="grey", linestyle="--", label="ceiling (unbounded)")
    axes.set_xscale("log")
    axes.set_xlabel("cache size (blocks)")
    axes.set_ylabel("prefix hit ratio")
    axes.legend()
    figure.tight_layout()
    save_figure(plt, figure, path, "--plot")

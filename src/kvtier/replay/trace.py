"""Request traces in the Mooncake format, and what an unbounded cache could get out of them."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvtier.errors import KvtierError

__all__ = ["BUNDLED_TRACES", "Request", "load_trace", "bundled_trace_path", "ceiling_hit_ratio"]

#: tokens per block of the Mooncake traces' ``hash_ids``
TRACE_BLOCK_TOKENS = 512
#: traces shipped with kvtier, by the name a command accepts in place of a path (see
#: ``kvtier/data/README.md``); ``synthetic`` is the default
BUNDLED_TRACES = {
    "synthetic": "mooncake_synthetic.jsonl",
    "conversation": "mooncake_conversation.jsonl.gz",
}


@dataclass(frozen=True)
class Request:
    """One request of a trace: arrival time, lengths, and its prompt's block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    #: one id per 512-token prompt block; equal leading ids are a shared prefix
    hash_ids: tuple[int, ...]


def bundled_trace_path(name: str = "synthetic") -> Path:
    """The path of the trace shipped with kvtier as ``name`` (one of :data:`BUNDLED_TRACES`)."""
    return Path(str(resources.files("kvtier") / "data" / BUNDLED_TRACES[name]))


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests (all if ``None``) of the JSONL trace at ``path``.

    ``path`` may also be gzip-compressed (``.gz``), or name a bundled trace
    (:data:`BUNDLED_TRACES`) when no such file exists. A missing file or a malformed line
    raises :class:`KvtierError` naming the file and line.
    """
    path = Path(path)
    if str(path) in BUNDLED_TRACES and not path.exists():
        path = bundled_trace_path(str(path))
    try:
        if path.suffix == ".gz":
            handle = gzip.open(path, "rt", encoding="utf-8")
        else:
            handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        names = ", ".join(BUNDLED_TRACES)
        raise KvtierError(
            f"cannot read trace {path}: {exc.strerror}; give a Mooncake-format JSONL file "
            f"(.jsonl or .jsonl.gz), a bundled trace's name ({names}), or no TRACE for the "
            f"bundled synthetic one"
        ) from exc
    requests: list[Request] = []
    try:
        with handle:
            for number, line in enumerate(handle, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    requests.append(
                        Request(
                            int(record["timestamp"]),
                            int(record["input_length"]),
                            int(record["output_length"]),
                            tuple(int(h) for h in record["hash_ids"]),
                        )
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise KvtierError(
                        f"{path} line {number}: not a trace record ({exc!r}); each line needs "
                        f"timestamp, input_length, output_length and hash_ids"
                    ) from exc
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # binary, or a damaged .gz
        raise KvtierError(
            f"cannot read trace {path}: {exc}; give a Mooncake-format JSONL text file, or a "
            f"whole gzip of one ending in .gz"
        ) from exc
    return requests


def ceiling_hit_ratio(requests: Iterable[Request]) -> tuple[float, int]:
    """Prefix-hit ratio of block references with an unbounded cache, and the reference count.

    A request hits the leading blocks that any earlier request had (``hash_ids`` chain their
    prefix, so a seen id means its whole prefix was seen too); no cache can do better.
    """
    seen: set[int] = set()
    hits = refs = 0
    for request in requests:
        ids: Sequence[int] = request.hash_ids
        refs += len(ids)
        for block_id in ids:
            if block_id not in seen:
                break
            hits += 1
        seen.update(ids)
    return (hits / refs if refs else 0.0), refs

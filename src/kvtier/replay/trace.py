"""Request traces in the Mooncake format, and what an unbounded cache could get out of them."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvtier.errors import TraceError, shown_value

__all__ = [
    "BUNDLED_TRACES",
    "Request",
    "TraceError",
    "load_trace",
    "parse_record",
    "bundled_trace_path",
    "ceiling_hit_ratio",
]

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


#: the longest trace line read, in characters: a request of 128k tokens is 256 ids (about 5
#: KB); a longer line (``/dev/zero``, a binary file) is refused, never read into memory whole
MAX_LINE_CHARS = 1 << 20
#: the exclusive upper bound of a hash id: replay hashes each as 8 bytes, so both commands
#: refuse what replay could not hash
HASH_ID_LIMIT = 1 << 64
#: the exclusive upper bound of a timestamp or a length
FIELD_LIMIT = 1 << 63
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests (all if ``None``) of the JSONL trace at ``path``.

    ``path`` may also be gzip-compressed (``.gz``), or name a bundled trace
    (:data:`BUNDLED_TRACES`) when no such file exists. Each line is one JSON object with
    ``timestamp``, ``input_length``, ``output_length`` (integers, 0 <= n < 2^63) and
    ``hash_ids`` (a list of integers, 0 <= id < 2^64); other keys are ignored. A missing
    file, a file that is not text, or a line that breaks any of this raises
    :class:`TraceError` naming the file, the line and the field. Every command that reads
    traces (``replay``, ``plan``) reads them here, so they accept the same ones.
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
        raise TraceError(
            f"cannot read trace {path}: {exc.strerror}; give a Mooncake-format JSONL file "
            f"(.jsonl or .jsonl.gz), a bundled trace's name ({names}), or no TRACE for the "
            f"bundled synthetic one"
        ) from exc
    requests: list[Request] = []
    try:
        with handle:
            number = 0
            while limit is None or len(requests) < limit:
                # bounded: readline() alone would read /dev/zero until memory runs out
                line = handle.readline(MAX_LINE_CHARS + 1)
                if not line:
                    break
                number += 1
                if len(line) > MAX_LINE_CHARS:
                    raise TraceError(
                        f"{path} line {number}: longer than {MAX_LINE_CHARS:,} characters; a "
                        "trace line is one request's JSON record (is this a trace file?)"
                    )
                if line.strip():
                    requests.append(parse_record(line, f"{path} line {number}"))
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:  # binary, or a damaged .gz
        raise TraceError(
            f"cannot read trace {path}: {exc}; give a Mooncake-format JSONL text file, or a "
            f"whole gzip of one ending in .gz"
        ) from exc
    return requests


def parse_record(line: str, where: str) -> Request:
    """One trace line as a :class:`Request`, or :class:`TraceError` naming ``where`` (the
    file and line) and the field at fault."""
    try:
        record = json.loads(line)
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply; a trace record is one flat object") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise TraceError(f"{where}: not JSON ({_short(exc)}); {_EXPECTED}") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: got {shown_value(record)}, not a JSON object; {_EXPECTED}")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise TraceError(f"{where}: no {', '.join(missing)}; {_EXPECTED}")
    timestamp, input_length, output_length = (
        _integer(record[name], name, where, FIELD_LIMIT) for name in _FIELDS[:3]
    )
    ids = record["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(
            f"{where}: hash_ids is {shown_value(ids)}; expected a list of integers 0 <= id < 2^64"
        )
    hash_ids = tuple(
        _integer(value, f"hash_ids[{index}]", where, HASH_ID_LIMIT) for index, value in enumerate(ids)
    )
    return Request(timestamp, input_length, output_length, hash_ids)


_EXPECTED = "each line needs timestamp, input_length, output_length and hash_ids"


def _integer(value: object, name: str, where: str, bound: int) -> int:
    # bool is an int to Python and 1e400 a float to json: neither is a trace's integer
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound:
        return value
    limit = "2^64" if bound == HASH_ID_LIMIT else "2^63"
    raise TraceError(f"{where}: {name} is {shown_value(value)}; expected an integer 0 <= n < {limit}")


def _short(exc: Exception) -> str:
    return shown_value(str(exc))[1:-1]


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

"""The recency log of a ``files`` store: appended (stamp, key) records, the eviction order
across restarts.

A record is its stamp (ns), the key's length, the key, then an xxh32 of those bytes; a damaged
tail ends the log (it is a hint, see :mod:`kvtier.tiers.disk.files`).
"""

from __future__ import annotations

import os
import struct

import xxhash

from kvtier.tiers.disk.store import open_private

__all__ = ["encode_records", "read_recency"]

# a recency record: stamp (ns), key length, key, then xxh32 of those bytes
_RECORD = struct.Struct("<QB")
_RECORD_SUM = struct.Struct("<I")


def read_recency(name: str, dir_fd: int) -> tuple[dict[bytes, int], int]:
    """The last stamp of each key in the log, and how many records it holds."""
    try:
        with open(open_private(name, os.O_RDONLY, dir_fd=dir_fd), "rb") as stream:
            data = stream.read()
    except FileNotFoundError:
        return {}, 0
    stamps: dict[bytes, int] = {}
    offset = records = 0
    end = len(data)
    while offset + _RECORD.size <= end:
        stamp, key_len = _RECORD.unpack_from(data, offset)
        stop = offset + _RECORD.size + key_len
        if stop + _RECORD_SUM.size > end:
            break
        if xxhash.xxh32_intdigest(data[offset:stop]) != _RECORD_SUM.unpack_from(data, stop)[0]:
            break  # a torn or damaged tail: what follows cannot be framed
        stamps[data[offset + _RECORD.size : stop]] = stamp
        records += 1
        offset = stop + _RECORD_SUM.size
    return stamps, records


def encode_records(keys, stamp: int) -> bytes:
    """The log records of ``keys`` all stamped ``stamp``, ready to append."""
    parts = []
    for key in keys:
        record = _RECORD.pack(stamp, len(key)) + key
        parts.append(record + _RECORD_SUM.pack(xxhash.xxh32_intdigest(record)))
    return b"".join(parts)

"""Run kvtier's copy kernel on the CPU (``TRITON_INTERPRET=1``) against the thread engine's
memmove over the same descriptors; exit 0 and print what was compared, or raise.

Run by ``test_kernel_engine.py`` in a fresh process: Triton reads ``TRITON_INTERPRET`` when
the kernel is defined, so the variable must be set before kvtier's kernel module loads it.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from kv_reference import copier_matches_memmove  # noqa: E402

from kvtier.worker.engines.kernel import (  # noqa: E402
    BLOCK,
    DescriptorTable,
    MAX_PARTS,
    PROGRAMS,
    copy_segments,
    element_bytes,
)

CPU = torch.device("cpu")


def planned_copies() -> int:
    """Both directions of a real plan, against the thread engine's memmove, with as many
    programs as work items and with fewer (each program then takes several in turn). One
    descriptor table serves every job, as an engine reuses its tables: it grows at the first
    and is larger than the later ones need."""
    table = DescriptorTable(CPU, 1)

    def copier(programs):
        return lambda dsts, srcs, sizes, _: copy_segments(
            dsts, srcs, sizes, CPU, programs=programs, table=table
        )

    compared = sum(copier_matches_memmove(copier(programs)) for programs in (PROGRAMS, 1, 3))
    assert table.capacity > 1, "the table never grew"
    return compared


def odd_copies() -> int:
    """Copies at odd addresses and lengths (byte-wide): one spanning several programs, one so
    long that each of its programs loops; nothing outside each range may change."""
    rng = np.random.default_rng(9)
    source = rng.integers(0, 256, 40_000, dtype=np.uint8)
    target = np.zeros(40_000, dtype=np.uint8)
    want = target.copy()
    looping = MAX_PARTS * BLOCK + 809
    ranges = [
        (1, 7, 3),
        (101, 2003, 17),
        (5000, 3001, BLOCK * 3 + 5),
        (9000, 20001, looping),
        (39000, 35000, 1),
    ]
    for src_at, dst_at, size in ranges:
        want[dst_at : dst_at + size] = source[src_at : src_at + size]
    u64 = lambda values: np.array(values, dtype=np.uint64)  # noqa: E731
    dsts = u64([target.ctypes.data + dst for _, dst, _ in ranges])
    srcs = u64([source.ctypes.data + src for src, _, _ in ranges])
    sizes = u64([size for _, _, size in ranges])
    assert element_bytes(dsts, srcs, sizes) == 1
    for programs in (PROGRAMS, 2):
        target[:] = 0
        copy_segments(dsts, srcs, sizes, CPU, programs=programs)
        np.testing.assert_array_equal(target, want)
    return len(ranges)


if __name__ == "__main__":
    print(f"ok: {planned_copies()} planned copies and {odd_copies()} odd ones match memmove")
    sys.exit(0)

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

from kvtier.tiers.cpu.region import SharedRegion  # noqa: E402
from kvtier.worker.blocks import TransferLayout  # noqa: E402
from kvtier.worker.engines.base import CopyBuffers  # noqa: E402
from kvtier.worker.engines.kernel import BLOCK, MAX_PARTS, copy_segments, element_bytes  # noqa: E402
from kvtier.worker.engines.thread import memmove_descriptors  # noqa: E402

PAGES = (24, 40, 6000)  # multiples of 8: the kernel moves them as 8-byte words


def planned_copies() -> int:
    """Both directions of a real plan (strided and contiguous tensors, a factor of 2)."""
    generator = torch.Generator().manual_seed(3)
    base = torch.randint(-128, 128, (6, 3, 40), dtype=torch.int8, generator=generator)
    gpu = [
        base[:, 0, :24],  # strided: 24 bytes of each 120-byte block
        torch.randint(-128, 128, (6, 40), dtype=torch.int8, generator=generator),
        torch.randint(-128, 128, (6, 6000), dtype=torch.int8, generator=generator),
    ]
    compared = 0
    with SharedRegion.create(5, 2 * sum(PAGES)) as region:
        region.rows[:] = np.random.default_rng(4).integers(0, 256, region.rows.shape, dtype=np.uint8)
        layout = TransferLayout(
            page_bytes=PAGES,
            block_size_factor=2,
            group_copy_bytes=[PAGES],
            gpu_num_blocks=[6, 6, 6],
            gpu_block_strides=[t.stride(0) for t in gpu],
            cpu_num_rows=5,
            cpu_row_stride=region.row_stride,
        )
        buffers = CopyBuffers(gpu, region)
        plans = [
            (layout.plan(np.array([5, 1, 2, 3]), [4], None, np.array([4, 0]), gpu_to_cpu=True), True),
            (layout.plan(np.array([5, 1, 2]), [3], [1], np.array([4, 0]), gpu_to_cpu=False), False),
        ]
        for segments, gpu_to_cpu in plans:
            start = ([t.clone() for t in gpu], region.rows.copy())
            descriptors = buffers.descriptors(segments, gpu_to_cpu)
            memmove_descriptors(*descriptors)
            want = ([t.clone() for t in gpu], region.rows.copy())
            for t, saved in zip(gpu, start[0]):
                t.copy_(saved)
            region.rows[:] = start[1]
            copy_segments(*descriptors, torch.device("cpu"))
            np.testing.assert_array_equal(region.rows, want[1])
            for t, expected in zip(gpu, want[0]):
                assert torch.equal(t, expected)
            assert (region.rows != start[1]).any() or any(
                not torch.equal(t, s) for t, s in zip(gpu, start[0])
            ), "the plan copied nothing"
            compared += len(descriptors[2])
    return compared


def odd_copies() -> int:
    """Copies at odd addresses and lengths (byte-wide): one spanning several programs, one so
    long that each of its programs loops; nothing outside each range may change."""
    rng = np.random.default_rng(9)
    source = rng.integers(0, 256, 40_000, dtype=np.uint8)
    target = np.zeros(40_000, dtype=np.uint8)
    want = target.copy()
    looping = MAX_PARTS * BLOCK + 809
    ranges = [(1, 7, 3), (101, 2003, 17), (5000, 3001, BLOCK * 3 + 5), (9000, 20001, looping),
              (39000, 35000, 1)]
    for src_at, dst_at, size in ranges:
        want[dst_at : dst_at + size] = source[src_at : src_at + size]
    u64 = lambda values: np.array(values, dtype=np.uint64)  # noqa: E731
    dsts = u64([target.ctypes.data + dst for _, dst, _ in ranges])
    srcs = u64([source.ctypes.data + src for src, _, _ in ranges])
    sizes = u64([size for _, _, size in ranges])
    assert element_bytes(dsts, srcs, sizes) == 1
    copy_segments(dsts, srcs, sizes, torch.device("cpu"))
    np.testing.assert_array_equal(target, want)
    return len(ranges)


if __name__ == "__main__":
    print(f"ok: {planned_copies()} planned copies and {odd_copies()} odd ones match memmove")
    sys.exit(0)

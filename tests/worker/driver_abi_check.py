"""kvtier's ctypes calls into the CUDA driver, run against ``driver_standin.c`` built as
``libcuda.so.1``; exit 0 and print what was checked, or raise.

Run by ``test_driver_abi.py`` in a fresh process whose ``LD_LIBRARY_PATH`` finds the stand-in
first (the loader reads it at start-up only).
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
from kv_reference import copier_matches_memmove

from kvtier import cuda
from kvtier.worker.engines.memcpy_batch import MemcpyBatch, MemcpyBatchError

STREAM = 0x5EED_F00D  # any handle: the stand-in only records it
MAPPED_AT = 0x100000  # HOST_TO_DEVICE_OFFSET in the stand-in


def main() -> None:
    driver = cuda.driver_library()
    assert driver is not None and hasattr(driver, "standin_last_order"), "not the stand-in"
    driver.standin_last_stream.restype = ctypes.c_uint64
    driver.standin_last_count.restype = ctypes.c_size_t
    driver.standin_last_stream_flags.restype = ctypes.c_uint

    batch = MemcpyBatch.load()
    assert batch is not None, "cuMemcpyBatchAsync not found through cuGetProcAddress_v2"

    orders = []

    def through_batch(dsts, srcs, sizes, gpu_to_cpu):
        # stores read GPU memory in stream order; loads may read their pinned rows early
        batch(dsts, srcs, sizes, STREAM, src_access_any=not gpu_to_cpu)
        assert driver.standin_last_stream() == STREAM
        assert driver.standin_last_count() == len(sizes)
        orders.append(driver.standin_last_order())

    compared = copier_matches_memmove(through_batch)
    assert orders == [1, 3], orders  # STREAM for the store, ANY for the load

    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, dtype=np.uint8)
    u64 = lambda *values: np.array(values, dtype=np.uint64)  # noqa: E731
    try:
        batch(
            u64(target.ctypes.data, 0),
            u64(source.ctypes.data, source.ctypes.data),
            u64(8, 8),
            STREAM,
            src_access_any=False,
        )
    except MemcpyBatchError as exc:
        assert (exc.code, exc.fail_index) == (1, 1), (exc.code, exc.fail_index)
    else:
        raise AssertionError("a refused copy did not raise")

    handles = [cuda.stream_create(0), cuda.stream_create(-1)]
    assert all(handles) and handles[0] != handles[1], handles
    assert (driver.standin_last_stream_flags(), driver.standin_last_stream_priority()) == (1, -1)
    assert driver.standin_live_streams() == 2

    assert cuda.device_address_offset(source.ctypes.data) == MAPPED_AT
    os.environ["STANDIN_UNMAPPED"] = "1"
    assert cuda.device_address_offset(source.ctypes.data) is None
    os.environ["STANDIN_CUDA_VERSION"] = "12060"  # a driver before cuMemcpyBatchAsync
    assert MemcpyBatch.load() is None
    print(f"ok: {compared} planned copies through the batched call; refusal, streams, mapping, old driver")


if __name__ == "__main__":
    main()
    sys.exit(0)

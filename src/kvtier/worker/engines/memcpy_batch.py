"""``cuMemcpyBatchAsync``: many host<->device copies in one driver call (CUDA 12.8+ drivers).

Why the driver API through ctypes: torch binds no batched copy, and the runtime's
``cudaMemcpyBatchAsync`` lives in whichever ``libcudart`` torch was built with. The driver
library is one per machine, and it keeps every published signature of a function reachable
by version: ``cuGetProcAddress_v2(name, &fn, 12080, 0, NULL)`` returns the CUDA 12.8 form of
``cuMemcpyBatchAsync`` (with its ``failIdx`` argument) on a 12.8 driver and on every later
one, including CUDA 13 drivers whose headers map the name to a ``_v2`` without that
argument. So the signature below is the one the returned pointer has, whatever the driver.

Nothing here is imported or called on a machine without CUDA; :meth:`MemcpyBatch.load`
returns ``None`` wherever the call is unavailable, and the CUDA engine then falls back to
one ``cudaMemcpyAsync`` per segment.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import numpy as np

from kvtier.cuda import driver_function

if TYPE_CHECKING:
    import _ctypes

__all__ = ["MemcpyBatch", "MemcpyBatchError"]

logger = logging.getLogger(__name__)

# The CUDA version whose signature of cuMemcpyBatchAsync is requested (12.8, the first).
_API_VERSION = 12080
_CU_GET_PROC_ADDRESS_DEFAULT = 0
# CUmemcpySrcAccessOrder
_SRC_ACCESS_ORDER_STREAM = 1
_SRC_ACCESS_ORDER_ANY = 3


class _MemLocation(ctypes.Structure):
    # CUmemLocation: a CUmemLocationType enum and an id; zeros mean "no hint"
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    # CUmemcpyAttributes (cuda.h, 12.8)
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_ARGTYPES = [
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # size_t count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # size_t numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream hStream
]


class MemcpyBatchError(RuntimeError):
    """The driver refused a batch; ``code`` is its CUresult, ``fail_index`` the first bad copy."""

    def __init__(self, code: int, fail_index: int):
        self.code = code
        self.fail_index = fail_index
        super().__init__(f"cuMemcpyBatchAsync failed with CUresult {code} at copy {fail_index}")


class MemcpyBatch:
    """A callable issuing a batch of copies on a stream with one driver call."""

    def __init__(self, function: _ctypes.CFuncPtr):
        self._function = function

    @classmethod
    def load(cls) -> MemcpyBatch | None:
        """The driver's batched copy, or ``None`` (logged at debug) where there is none.

        Called once per engine at start-up, from a process that already uses CUDA.
        """
        version = ctypes.c_int(0)
        get_version = driver_function("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        if get_version is None or get_version(ctypes.byref(version)) != 0:
            return None  # no driver (logged by driver_library)
        if version.value < _API_VERSION:
            logger.debug("CUDA driver %d has no cuMemcpyBatchAsync", version.value)
            return None
        # the form every 12.x and 13.x driver exports (the first one, without symbolStatus,
        # is kept only for programs built before 12.0)
        get_proc = driver_function(
            "cuGetProcAddress_v2",
            [
                ctypes.c_char_p,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_int,
                ctypes.c_uint64,
                ctypes.c_void_p,  # CUdriverProcAddressQueryResult *symbolStatus: optional
            ],
        )
        if get_proc is None:
            return None
        address = ctypes.c_void_p(0)
        code = get_proc(
            b"cuMemcpyBatchAsync",
            ctypes.byref(address),
            _API_VERSION,
            _CU_GET_PROC_ADDRESS_DEFAULT,
            None,
        )
        if code != 0 or not address.value:
            logger.debug("cuGetProcAddress(cuMemcpyBatchAsync) returned %d", code)
            return None
        function = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGTYPES)(address.value)
        return cls(function)

    def __call__(
        self,
        dsts: np.ndarray,
        srcs: np.ndarray,
        sizes: np.ndarray,
        stream_handle: int,
        *,
        src_access_any: bool,
    ) -> None:
        """Enqueue ``len(sizes)`` copies on the stream; raise :class:`MemcpyBatchError` if refused.

        ``dsts``, ``srcs``, ``sizes``: contiguous uint64 arrays. ``src_access_any`` lets the
        copy engine read the sources out of stream order: only for sources no GPU stream
        writes meanwhile (the CPU rows of a load, which the manager keeps pinned).
        Called on the thread that submits to the stream; never waits for the copies.
        """
        count = len(sizes)
        if count == 0:
            return
        for array in (dsts, srcs, sizes):
            assert array.dtype == np.uint64 and array.flags.c_contiguous
        attrs = _MemcpyAttributes(
            srcAccessOrder=_SRC_ACCESS_ORDER_ANY if src_access_any else _SRC_ACCESS_ORDER_STREAM
        )
        attrs_index = ctypes.c_size_t(0)
        fail_index = ctypes.c_size_t(~0 & 0xFFFFFFFFFFFFFFFF)
        code = self._function(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(attrs),
            ctypes.addressof(attrs_index),
            1,
            ctypes.addressof(fail_index),
            stream_handle,
        )
        if code != 0:
            raise MemcpyBatchError(code, fail_index.value)

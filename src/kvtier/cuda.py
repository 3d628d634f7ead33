"""The few CUDA runtime calls kvtier makes outside of torch's tensor API.

Everything here is safe to call on a machine without CUDA, and cheap there: importing torch
costs over a second, so :func:`cuda_available` only imports it when the process has already
done so or when an NVIDIA device node shows that CUDA could work at all. The scheduler process
of a CPU-only deployment (CI, laptops, a disk-tier tool) therefore never pays for torch.

Pinning is an optimisation, never a requirement for correctness: copies between a GPU and
pageable host memory still work, only slower and synchronously staged by the driver. So a
failed registration is logged once and reported as ``False``; callers that insist on pinned
memory (``pin_memory: on``) turn that into an error themselves.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import _ctypes

__all__ = [
    "cuda_available",
    "device_address_offset",
    "driver_function",
    "driver_library",
    "host_register",
    "host_unregister",
    "resolve_device",
    "stream_create",
]

# cuStreamCreateWithPriority's flag: no implicit synchronisation with the legacy default
# stream (torch creates its own streams so too)
_CU_STREAM_NON_BLOCKING = 0x1

logger = logging.getLogger(__name__)

# Any of these existing means an NVIDIA driver is loaded; without one torch cannot see a GPU,
# so there is no point paying for its import.
_NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


def cuda_available() -> bool:
    """Whether a CUDA device can be used by this process.

    Called from any thread or process, typically once at start-up. Never blocks on I/O; it
    imports torch (slow, about a second) only if torch is already imported or an NVIDIA device
    node exists. Not cached, so a test can change the answer by patching this module.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        if not any(os.path.exists(node) for node in _NVIDIA_DEVICE_NODES):
            return False
        try:
            import torch
        except ImportError:
            return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install must read as "no CUDA", not crash start-up
        logger.debug("torch.cuda.is_available() failed", exc_info=True)
        return False


def resolve_device(device: str, option: str = "--device") -> str:
    """``cpu`` or ``cuda`` for a command's ``option``: ``auto`` is cuda where it is available;
    :class:`~kvtier.errors.ConfigError` for another name, or for cuda where there is none."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(option, device, "one of auto, cpu, cuda")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise ConfigError(
            option, device, "a device torch can use", "CUDA is not available here: use cpu or auto"
        )
    return device


def _clear_last_error() -> None:
    # A failed cudaHostRegister leaves its code as the runtime's "last error". torch checks
    # kernel launches with cudaGetLastError, so the stale code would surface later as a
    # confusing failure of some unrelated kernel. torch.cuda.cudart() does not bind
    # cudaGetLastError, so reach the runtime torch already loaded through its soname;
    # best effort: if that copy cannot be found there is nothing better to do.
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return
    for soname in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            # RTLD_NOLOAD: only find a copy that is already loaded, never load a second one
            # (a second copy would have its own, unrelated error state).
            runtime = ctypes.CDLL(soname, mode=noload)
            runtime.cudaGetLastError()
        except (OSError, AttributeError):
            continue
        return


def host_register(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of existing host memory at ``ptr`` for DMA (``cudaHostRegister``).

    Called once per region by the process that will copy to or from a GPU (the worker). It
    blocks while the driver faults in and locks every page: about a second per few GiB.
    Returns ``True`` if the range is now registered (and must later be given to
    :func:`host_unregister`), ``False`` with one logged warning otherwise.
    """
    if not ptr or nbytes <= 0:
        return False
    try:
        import torch

        code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    except Exception as exc:  # no CUDA build, no device, driver gone: all mean "stay pageable"
        logger.warning(
            "cannot pin %d bytes at 0x%x for DMA (%s); GPU copies will use pageable memory and be slower",
            nbytes,
            ptr,
            exc,
        )
        return False
    if code != 0:
        _clear_last_error()
        logger.warning(
            "cudaHostRegister of %d bytes at 0x%x failed with CUDA error %d; GPU copies will "
            "use pageable memory and be slower",
            nbytes,
            ptr,
            code,
        )
        return False
    return True


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` for the range starting at ``ptr`` (``cudaHostUnregister``).

    Called by the process that registered the range, before the memory is unmapped, and only
    once no copy uses it any more. Never raises: a failure is logged once.
    """
    if not ptr:
        return
    try:
        import torch

        code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as exc:
        logger.warning("cannot unpin host memory at 0x%x (%s)", ptr, exc)
        return
    if code != 0:
        _clear_last_error()
        logger.warning("cudaHostUnregister at 0x%x failed with CUDA error %d", ptr, code)


@functools.cache
def driver_library() -> ctypes.CDLL | None:
    """The CUDA driver library (``libcuda.so.1``), loaded once per process; ``None`` (logged at
    debug) where there is none. The driver API calls kvtier makes through ctypes go here:
    torch binds none of them. Safe anywhere; loading the library does not initialise CUDA.
    """
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        logger.debug("no CUDA driver library: %s", exc)
        return None


def driver_function(name: str, argtypes: list) -> _ctypes.CFuncPtr | None:
    """The driver entry point ``name`` with its argument types set (returning a CUresult as
    an int), or ``None`` where there is no driver or no such entry point."""
    driver = driver_library()
    function = getattr(driver, name, None) if driver is not None else None
    if function is not None:
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return function


def device_address_offset(ptr: int) -> int | None:
    """Where registered host memory at ``ptr`` sits in the current device's address space, as
    an offset from ``ptr`` (0 under unified addressing), or ``None`` if a kernel cannot reach
    it (not registered, not mapped, no driver).

    Asks the driver (``cuMemHostGetDevicePointer``) in the calling thread's current context:
    call it after CUDA is initialised on the device the kernels will run on. Never raises.
    """
    query = driver_function(
        "cuMemHostGetDevicePointer_v2",
        [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint],
    )
    if not ptr or query is None:
        return None
    device_ptr = ctypes.c_uint64(0)
    if query(ctypes.byref(device_ptr), ctypes.c_void_p(ptr), 0) != 0:
        return None
    return device_ptr.value - ptr


def stream_create(priority: int) -> int | None:
    """A CUDA stream of the caller's own (``cuStreamCreateWithPriority``, non-blocking), as its
    handle, or ``None`` (logged at debug) where there is no driver or it refuses.

    Why not ``torch.cuda.Stream``: torch hands out one of 32 streams per priority, round-robin,
    shared with every other ``torch.cuda.Stream()`` in the process, so a copy stream can turn out
    to be the model's own stream (vLLM computes on one of them) and queue its copies behind the
    model's work. ``priority``: lower is more urgent; the driver clamps it to the device's
    range. Call it in a thread whose current context is the device's (any torch CUDA call on
    the device there makes it so). kvtier never destroys these streams: see
    :mod:`kvtier.worker.engines.cuda`, which pools them.
    """
    create = driver_function(
        "cuStreamCreateWithPriority",
        [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int],
    )
    if create is None:
        return None
    handle = ctypes.c_void_p(0)
    code = create(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING, priority)
    if code != 0 or not handle.value:
        logger.debug("cuStreamCreateWithPriority returned %d", code)
        return None
    return handle.value

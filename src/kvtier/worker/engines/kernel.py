"""The CUDA path with the copies done by a kernel: SMs read and write the pinned rows directly.

:class:`KernelCopyEngine` is :class:`~kvtier.worker.engines.cuda.CudaCopyEngine` — the same
streams, priorities, waits on the compute stream, chaining and events — with one step
replaced: instead of handing each job's ``(dst, src, size)`` descriptors to the copy engines
(``cuMemcpyBatchAsync``), it launches :func:`copy_segments`, a Triton kernel that walks the
same descriptors and moves the bytes with loads and stores from the SMs. Host rows are
reached through the device's view of them: memory registered with ``cudaHostRegister`` is
mapped into the device's address space (at the same address on 64-bit platforms with unified
addressing); the engine asks the driver where, once, and refuses to start if the rows are
not reachable, since a kernel touching unmapped host memory would poison the CUDA context.

Why have it: a DMA descriptor has a fixed cost, so many small pages move below the link's
rate, while a kernel's cost grows with the bytes only. It is not the default: it occupies SMs
the model could use (docs/design/worker.md#the-copy-kernel). ``kvtier bench transfer --device
cuda`` times both engines; the engine is chosen by name (``engine="kernel"``).

:func:`copy_segments` is device-agnostic: under ``TRITON_INTERPRET=1`` it runs on the CPU
over CPU memory, which is how the tests prove on a machine without a GPU that it copies
exactly what the DMA path and the thread engine copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.worker.blocks import Segments
from kvtier.worker.engines.base import CopyBuffers
from kvtier.worker.engines.cuda import CudaCopyEngine

__all__ = ["DescriptorTable", "KernelCopyEngine", "copy_segments", "element_bytes"]

#: elements one program copies per loop turn (of the widest width every copy allows)
BLOCK = 1024
#: most work items one segment is cut into: enough to spread a long segment over the
#: programs, few enough that short ones (the common case) make no idle items
MAX_PARTS = 8
#: programs (so SMs, at most) one job's kernel occupies: a few SMs saturate PCIe, the rest
#: stay with the model (docs/design/worker.md#the-copy-kernel)
PROGRAMS = 12
#: descriptors the engine's first tables hold (jobs of 256 blocks of 32 layers)
WARM_DESCRIPTORS = 256 * 32

_kernel: Any = None


def _load_kernel() -> Any:
    """The Triton kernel, compiled lazily per element width; ImportError without Triton."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    # ``count`` and ``parts`` change from job to job: specialising on them (Triton compiles
    # separate variants for 1 and for multiples of 16) would compile kernels mid-serving.
    @triton.jit(do_not_specialize=["count", "parts"])
    def copy_kernel(table, count, parts, WIDTH: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
        # table: int64 [dst addresses..., src addresses..., sizes in bytes...], count each.
        # Work item (segment, part): every parts-th BLOCK of the segment's WIDTH-byte words,
        # from the part-th on. The programs take the items in turn (a persistent grid), so a
        # job occupies as many SMs as it has programs, whatever its size.
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        for item in range(program, count * parts, programs):
            segment = item // parts
            part = item % parts
            dst = tl.load(table + segment).to(tl.pointer_type(KIND))
            src = tl.load(table + count + segment).to(tl.pointer_type(KIND))
            n = tl.load(table + 2 * count + segment) // WIDTH
            for start in range(part * BLOCK, n, parts * BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                mask = offsets < n
                tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    _kernel = (copy_kernel, {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8})
    return _kernel


def element_bytes(*arrays: npt.ArrayLike) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every value in ``arrays`` (the addresses and
    sizes of some copies): the unit each load and store moves, so no copy touches a byte
    outside its own range."""
    values = [np.asarray(a, dtype=np.uint64).ravel() for a in arrays]
    low_bits = int(np.bitwise_or.reduce(np.concatenate(values))) & 7 if values else 0
    return 8 if low_bits == 0 else low_bits & -low_bits


def copy_segments(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    device: torch.device,
    *,
    programs: int = PROGRAMS,
    table: DescriptorTable | None = None,
    max_width: int = 8,
) -> DescriptorTable | None:
    """Launch the copy kernel for one job's descriptors on ``device``'s current stream.

    ``dsts``, ``srcs``, ``sizes``: uint64 arrays, one entry per copy, as
    :meth:`~kvtier.worker.engines.base.CopyBuffers.descriptors` returns them; the ranges
    must not overlap. ``programs``: how many programs (SMs, at most) share the work.
    ``table``: where the descriptors go on their way to the kernel (a new one if omitted).
    ``max_width``: the widest word to move (an engine caps it at its layout's, so every job
    runs the kernel compiled at start-up).
    Returns that table, which must not be reused or dropped until the stream has passed the
    kernel, or ``None`` when there is nothing to copy. Called on the thread that owns the
    current stream; never waits for the copy.
    """
    count = len(sizes)
    if count == 0:
        return None
    kernel, kinds = _load_kernel()
    width = min(max_width, element_bytes(dsts, srcs, sizes))
    table = table or DescriptorTable(device, count)
    descriptors = table.load(dsts, srcs, sizes)
    longest = int(sizes.max()) // width
    parts = max(1, min(MAX_PARTS, -(-longest // BLOCK)))
    grid = (max(1, min(programs, count * parts)),)
    kernel[grid](descriptors, count, parts, WIDTH=width, KIND=kinds[width], BLOCK=BLOCK)
    return table


class DescriptorTable:
    """Room for one job's descriptor table on its way to the kernel: a pinned host buffer and
    a device buffer, reused job after job (by one job at a time), grown when a job needs more.

    Pinned, because a host-to-device copy from pageable memory first waits for everything
    queued on its stream, and a job's stream waits for the compute stream: the model's thread
    would block in ``transfer_async`` until the model's queued work is done. Owned, because
    allocating pinned memory per job (``cudaHostAlloc``, whenever a size is new to torch's
    cache) can itself stall the submitting thread for milliseconds. On the CPU (the
    interpreter) one buffer serves as both.
    """

    def __init__(self, device: torch.device, capacity: int = 1):
        """``capacity``: descriptors it holds before it grows. Allocates on ``device``."""
        self.device = device
        self.capacity = 0
        self._grow(max(1, capacity))

    def _grow(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self._host = torch.empty(3 * capacity, dtype=torch.int64, pin_memory=cuda)
        self._host_view = self._host.numpy()
        self._on_device = (
            torch.empty(3 * capacity, dtype=torch.int64, device=self.device) if cuda else self._host
        )
        self.capacity = capacity

    def reserve(self, count: int) -> None:
        """Make room for ``count`` descriptors now (allocating on the current stream), not in
        :meth:`load`. Only while no job uses the table."""
        if count > self.capacity:
            self._grow(max(count, 2 * self.capacity))

    def load(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
        """The descriptors as int64 ``[dsts..., srcs..., sizes...]`` on the device, copied there
        on the current stream; never waits for the stream. Only while no job uses the table."""
        count = len(sizes)
        self.reserve(count)
        for index, column in enumerate((dsts, srcs, sizes)):
            self._host_view[index * count : (index + 1) * count] = column.view(np.int64)
        if self._on_device is self._host:
            return self._host[: 3 * count]
        on_device = self._on_device[: 3 * count]
        on_device.copy_(self._host[: 3 * count], non_blocking=True)
        return on_device


class KernelCopyEngine(CudaCopyEngine):
    """:class:`CudaCopyEngine` whose jobs are copied by :func:`copy_segments` on their stream.

    Same contract, same stream discipline; only the step that moves the bytes differs. Needs
    Triton (it comes with PyTorch's CUDA builds on Linux).
    """

    def __init__(self, buffers: CopyBuffers, gpu_to_cpu: bool, *, priority: int = 0):
        super().__init__(buffers, gpu_to_cpu, priority=priority)
        try:
            self._start(buffers)
        except BaseException:
            self.shutdown()  # give the streams back
            raise

    def _start(self, buffers: CopyBuffers) -> None:
        try:
            _load_kernel()
        except ImportError as exc:
            raise ValueError(
                "the kernel copy engine needs Triton, which PyTorch's CUDA builds bring along; "
                f"install it (pip install triton) or use engine='cuda' ({exc})"
            ) from exc
        if self.rows_mapped_at is None:
            # A kernel reading host memory the GPU cannot reach would not fail one job: it
            # would poison the whole CUDA context. Refuse here instead.
            raise ValueError(
                "the kernel copy engine reads and writes the CPU rows from the GPU, which needs "
                "them pinned and mapped (cudaHostRegister); pin the region (pin_memory: on) or "
                "use engine='cuda'"
            )
        #: device address minus host address of the rows (0 under unified addressing)
        self.host_offset = np.uint64(self.rows_mapped_at % (1 << 64))
        #: programs each job's kernel runs (see :data:`PROGRAMS`)
        self.programs = PROGRAMS
        #: the widest word every copy of this layout allows (addresses, strides, page sizes):
        #: jobs use no wider one, so they all run the kernel compiled below
        self.layout_width = element_bytes(
            buffers.gpu_bases,
            buffers.gpu_strides,
            buffers.page_bytes,
            [buffers.cpu_base + self.host_offset, buffers.row_stride],
        )
        self._tables: list[DescriptorTable] = []
        try:
            self._warm_up()
        except Exception as exc:  # Triton builds a launcher with the C compiler, then the kernel
            raise ValueError(
                f"the kernel copy engine could not compile its kernel ({type(exc).__name__}: "
                f"{exc}); Triton needs a C compiler and Python's headers at run time; or use "
                "engine='cuda'"
            ) from exc

    def _warm_up(self) -> None:
        # Triton compiles a kernel at its first launch (about a second): done here, at
        # start-up, for the width this layout's copies use, not inside the first job's submit
        # on the model's thread (a job narrower than the layout, which no planned job is,
        # would compile its own). Two tables, sized for jobs of 256 blocks of 32 layers, are
        # allocated now for the same reason.
        width = self.layout_width
        with torch.cuda.device(self._device):
            scratch = torch.zeros(2, dtype=torch.int64, device=self._device)
            base = scratch.data_ptr()
            dst, src, size = np.array([[base + 8], [base], [width]], dtype=np.uint64)
            tables = [DescriptorTable(self._device, WARM_DESCRIPTORS) for _ in range(2)]
            copy_segments(dst, src, size, self._device, table=tables[0], max_width=width)
            torch.cuda.synchronize(self._device)  # the scratch and the table are read by now
        self._tables += tables

    def _prepare(self, descriptors: tuple[np.ndarray, np.ndarray, np.ndarray]) -> DescriptorTable:
        # The job keeps its table until its end event passed, failed or not (a copy into it
        # may be queued); a new one is made where none is free (allocated outside any copy
        # stream, on the submitting thread's current stream).
        count = len(descriptors[2])
        table = self._tables.pop() if self._tables else DescriptorTable(self._device, count)
        table.reserve(count)
        return table

    def _issue(
        self,
        descriptors: tuple[np.ndarray, np.ndarray, np.ndarray],
        segments: Segments,
        stream: torch.cuda.Stream,
        prepared: DescriptorTable,
    ) -> None:
        dsts, srcs, sizes = descriptors
        if self.host_offset:  # the rows' addresses as the GPU sees them (uint64 wraps)
            if self.gpu_to_cpu:
                dsts = dsts + self.host_offset
            else:
                srcs = srcs + self.host_offset
        copy_segments(
            dsts,
            srcs,
            sizes,
            self._device,
            programs=self.programs,
            table=prepared,
            max_width=self.layout_width,
        )

    def _release(self, issued: DescriptorTable) -> None:
        self._tables.append(issued)  # the job that used it is done

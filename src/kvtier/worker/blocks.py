"""Which bytes of the engine's KV cache go to which bytes of the CPU tier: pure numpy.

Everything the worker side decides about *where* bytes go lives here, in functions of arrays
with no torch and no device, so that the CPU path and the CUDA path copy exactly the same
byte ranges and the arithmetic is tested once, thoroughly, without a GPU.

The CPU row layout (the contract with the disk tiers)
-----------------------------------------------------
One CPU tier row holds one offloaded block (one :data:`~kvtier.base.OffloadKey`). An
offloaded block spans ``factor`` GPU blocks (``block_size_tokens = factor x`` the engine's
block size). Inside a row, for each canonical tensor ``t`` in ``kv_caches.tensors`` order,
come ``factor`` consecutive pages of ``page_bytes[t]`` bytes (the tensor's padded page size)::

    row:  | t0 page 0 | t0 page 1 | ... | t0 page f-1 | t1 page 0 | ... | t(n-1) page f-1 |
    tensor_offsets[t] = factor * sum(page_bytes[:t]);  block_bytes = factor * sum(page_bytes)

so a row is the same bytes whatever process or tier holds it, and moves to disk as one
contiguous write. Under tensor or pipeline parallelism this layout is one worker's *shard*,
and a row holds every worker's shard side by side (:mod:`kvtier.worker.shards`): worker
``r``'s offsets all start at its ``shard_offset``. A key of KV group ``g`` only touches the segments of the tensors that
group ``g`` references (``kv_caches.group_data_refs[g]``), and within each page only the
group's un-padded page size; every other byte of the row is never written nor read.

Specs
-----
A transfer names GPU blocks with a :class:`~kvtier.mediums.GPULoadStoreSpec` (ids ordered by
KV group, ``group_sizes[g]`` of them for group ``g``) and CPU rows with a
:class:`~kvtier.mediums.CPULoadStoreSpec` (one id per offloaded block, groups in the same
order). Page ``p`` of group ``g`` (counted from the start of its first offloaded block) lives
in CPU row ``cpu_ids[p // factor]`` at page slot ``p % factor``.

* A **store** (GPU to CPU) is aligned: group ``g``'s GPU blocks fill whole offloaded blocks,
  so ``group_sizes[g]`` is a multiple of ``factor`` and ``block_indices[g] % factor == 0``.
  A partly written row would later be served as a whole block, so an unaligned store is
  refused rather than half done.
* A **load** (CPU to GPU) may start in the middle of an offloaded block: group ``g``'s first
  GPU block is page ``block_indices[g] % factor`` of its first row; its last row may be
  used only in part.

Errors: a spec that contradicts the layout (wrong counts, ids out of range, two copies
writing the same bytes, an unaligned store) is a caller bug and raises ``ValueError`` naming
what is wrong. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Segments", "TransferLayout", "coalesce", "expand_block_ids"]


def expand_block_ids(
    block_ids: np.ndarray,
    block_size_factor: int,
    output: np.ndarray,
    skip_count: int = 0,
) -> None:
    """Write into ``output`` the ids of the small blocks that ``block_ids`` are made of.

    Each id ``b`` stands for ``block_size_factor`` consecutive small blocks
    ``b*f, b*f+1, ..., b*f+f-1``; the first ``skip_count`` of the whole sequence are skipped
    and ``len(output)`` ids are written (so the last large block may be used in part).
    ``[0, 1, 3]`` with factor 4 gives ``[0..7, 12..15]``; with ``skip_count=2`` and an
    output of 5 it gives ``[2, 3, 4, 5, 6]``.

    Any thread; never blocks. Raises ``ValueError`` if ``skip_count`` is not in
    ``[0, factor)`` or ``output`` asks for more ids than the blocks hold.
    """
    factor = int(block_size_factor)
    if factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if not 0 <= skip_count < factor:
        raise ValueError(f"skip_count must be in [0, {factor}), got {skip_count}")
    count = len(output)
    available = len(block_ids) * factor - skip_count
    if count > available:
        raise ValueError(
            f"output wants {count} ids but {len(block_ids)} blocks of factor {factor} "
            f"after skipping {skip_count} hold only {max(available, 0)}"
        )
    ids = np.asarray(block_ids, dtype=np.int64)
    if factor == 1:
        output[:] = ids[skip_count : skip_count + count]
        return
    expanded = (ids[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).ravel()
    output[:] = expanded[skip_count : skip_count + count]


@dataclass(frozen=True)
class Segments:
    """The byte copies of one transfer job, coalesced: copy ``i`` moves ``sizes[i]`` bytes
    between GPU tensor ``tensor_idx[i]`` at ``gpu_offsets[i]`` (bytes from the start of its
    block 0) and the CPU region at ``cpu_offsets[i]`` (bytes from the start of row 0).

    No two copies write the same byte (checked when the job is planned), so they may run in
    any order or all at once. ``nbytes`` is the total payload of the job.
    """

    tensor_idx: np.ndarray
    gpu_offsets: np.ndarray
    cpu_offsets: np.ndarray
    sizes: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return len(self.sizes)

    def nothing(self) -> Segments:
        """No copies at all (a job checked against the layout whose bytes another rank moves)."""
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty, empty, empty, 0)


def coalesce(
    tensor_idx: np.ndarray, gpu_offsets: np.ndarray, cpu_offsets: np.ndarray, sizes: np.ndarray
) -> Segments:
    """Merge each copy into the one before it when both sides continue where it ended.

    Input order is kept (a merge only joins neighbours), so callers list pages in address
    order per tensor to get long runs: with consecutive block ids and full pages a whole
    offloaded block of one tensor, or more, becomes one copy. Any thread; never blocks.
    """
    count = len(sizes)
    if count == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty, empty, empty, 0)
    starts_new = np.ones(count, dtype=bool)
    ends = slice(None, -1)
    starts_new[1:] = (
        (tensor_idx[1:] != tensor_idx[ends])
        | (gpu_offsets[1:] != gpu_offsets[ends] + sizes[ends])
        | (cpu_offsets[1:] != cpu_offsets[ends] + sizes[ends])
    )
    first = np.flatnonzero(starts_new)
    merged_sizes = np.add.reduceat(sizes, first)
    return Segments(
        tensor_idx=tensor_idx[first],
        gpu_offsets=gpu_offsets[first],
        cpu_offsets=cpu_offsets[first],
        sizes=merged_sizes,
        nbytes=int(merged_sizes.sum()),
    )


def _check_disjoint(buffer_idx: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, what: str) -> None:
    """Raise ValueError if two copies would write overlapping bytes of one buffer.

    Copies of one job may run concurrently (a batched DMA gives no order among its
    descriptors), so overlapping destinations would leave bytes that depend on timing.
    """
    if len(sizes) < 2:
        return
    order = np.lexsort((offsets, buffer_idx))
    buf, off, size = buffer_idx[order], offsets[order], sizes[order]
    same = buf[1:] == buf[:-1]
    overlap = same & (off[1:] < off[:-1] + size[:-1])
    if overlap.any():
        i = int(np.flatnonzero(overlap)[0])
        raise ValueError(
            f"the spec names the same {what} bytes twice (offset {int(off[i + 1])} of buffer "
            f"{int(buf[i + 1])} is written by two copies): a destination block appears twice"
        )


class TransferLayout:
    """The geometry both sides of a CPU<->GPU transfer agree on, and the planner of its copies.

    Built once per worker (by :class:`~kvtier.worker.cpu_gpu.CpuGpuOffloadingHandlers`) from
    the engine's KV cache and the CPU region; :meth:`plan` is then called by the handler's
    caller thread for each job. Immutable after construction, so it may be shared by the two
    directions.
    """

    def __init__(
        self,
        *,
        page_bytes: Sequence[int],
        block_size_factor: int,
        group_copy_bytes: Sequence[Sequence[int]],
        gpu_num_blocks: Sequence[int],
        gpu_block_strides: Sequence[int],
        cpu_num_rows: int,
        cpu_row_stride: int,
        shard_offset: int = 0,
    ):
        """
        ``page_bytes[t]``: tensor ``t``'s (padded) page size; ``group_copy_bytes[g][t]``: how
        many bytes of each page of tensor ``t`` group ``g`` uses (0: not referenced);
        ``gpu_num_blocks[t]`` / ``gpu_block_strides[t]``: rows of GPU tensor ``t`` and bytes
        between them; ``cpu_num_rows`` / ``cpu_row_stride``: the CPU region's geometry.
        Raises ``ValueError`` on inconsistent geometry.
        """
        self.page_bytes = tuple(int(p) for p in page_bytes)
        self.factor = int(block_size_factor)
        num_tensors = len(self.page_bytes)
        if num_tensors == 0:
            raise ValueError("the KV cache has no tensors")
        if self.factor < 1:
            raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
        if any(p < 1 for p in self.page_bytes):
            raise ValueError(f"page sizes must be >= 1 byte, got {list(self.page_bytes)}")
        if len(gpu_num_blocks) != num_tensors or len(gpu_block_strides) != num_tensors:
            raise ValueError("gpu_num_blocks and gpu_block_strides need one entry per tensor")
        self.group_copy_bytes = tuple(tuple(int(c) for c in group) for group in group_copy_bytes)
        for g, group in enumerate(self.group_copy_bytes):
            if len(group) != num_tensors:
                raise ValueError(f"group {g} lists {len(group)} tensors, the cache has {num_tensors}")
            for t, copy in enumerate(group):
                if not 0 <= copy <= self.page_bytes[t]:
                    raise ValueError(
                        f"group {g} uses {copy} bytes of tensor {t}'s {self.page_bytes[t]}-byte pages"
                    )
        self.gpu_num_blocks = tuple(int(n) for n in gpu_num_blocks)
        self.gpu_block_strides = tuple(int(s) for s in gpu_block_strides)
        for t, (stride, page) in enumerate(zip(self.gpu_block_strides, self.page_bytes)):
            if stride < page:
                raise ValueError(f"tensor {t}: block stride {stride} is smaller than its page {page}")
        self.shard_offset = int(shard_offset)
        if self.shard_offset < 0:
            raise ValueError(f"shard_offset must be >= 0, got {shard_offset}")
        # offsets from the start of the row: the worker's shard first, then its tensors
        offsets = np.concatenate(([0], np.cumsum(self.page_bytes)[:-1])) * self.factor
        self.tensor_offsets = tuple(self.shard_offset + int(o) for o in offsets)
        #: bytes of this worker's shard of a block
        self.block_bytes = self.factor * sum(self.page_bytes)
        self.cpu_num_rows = int(cpu_num_rows)
        self.cpu_row_stride = int(cpu_row_stride)
        if self.cpu_row_stride < self.shard_offset + self.block_bytes:
            raise ValueError(
                f"CPU rows of stride {self.cpu_row_stride} cannot hold a shard of "
                f"{self.block_bytes} bytes at offset {self.shard_offset}"
            )
        # Per group, as column vectors over the tensors it copies, so that a plan is a few
        # broadcast operations per group whatever the number of layers (one numpy call per
        # tensor cost ~10 us x 64 tensors, more than the DMA of a small batch).
        self._group_columns = tuple(self._columns(group) for group in self.group_copy_bytes)

    def _columns(
        self, copy_bytes: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        tensors = np.array([t for t, copy in enumerate(copy_bytes) if copy], dtype=np.int64)
        # the fewest GPU blocks among them: ids are checked against it, so a plan never
        # addresses past the end of a tensor
        limit = min((self.gpu_num_blocks[t] for t in tensors), default=0)

        def column(values: Sequence[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)[tensors][:, None]

        return (
            tensors[:, None],
            column(self.gpu_block_strides),
            column(self.tensor_offsets),
            column(self.page_bytes),
            column(copy_bytes),
            limit,
        )

    @property
    def num_groups(self) -> int:
        """How many KV groups the engine has (``len(group_sizes)`` of every GPU spec)."""
        return len(self.group_copy_bytes)

    def plan(
        self,
        gpu_block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int] | None,
        cpu_block_ids: np.ndarray,
        *,
        gpu_to_cpu: bool,
    ) -> Segments:
        """The coalesced copies of one job; ``ValueError`` if the spec contradicts the layout.

        Called by a handler's caller thread at ``transfer_async``; never blocks, costs a few
        numpy operations per KV group (about 60 us for 32 blocks of 32 layers).
        """
        factor = self.factor
        direction = "store" if gpu_to_cpu else "load"
        gpu_ids = np.asarray(gpu_block_ids, dtype=np.int64)
        cpu_ids = np.asarray(cpu_block_ids, dtype=np.int64)
        if len(group_sizes) != self.num_groups:
            raise ValueError(
                f"the GPU spec has {len(group_sizes)} groups, the KV cache has {self.num_groups}"
            )
        if block_indices is not None and len(block_indices) != len(group_sizes):
            raise ValueError(f"block_indices has {len(block_indices)} entries for {len(group_sizes)} groups")
        if any(size < 0 for size in group_sizes) or sum(group_sizes) != len(gpu_ids):
            raise ValueError(
                f"group_sizes {list(group_sizes)} do not partition the {len(gpu_ids)} GPU block ids"
            )
        if len(cpu_ids) and (cpu_ids.min() < 0 or cpu_ids.max() >= self.cpu_num_rows):
            raise ValueError(
                f"CPU block ids must be in [0, {self.cpu_num_rows}); got "
                f"{int(cpu_ids.min())}..{int(cpu_ids.max())}"
            )

        pieces_t, pieces_gpu, pieces_cpu, pieces_size = [], [], [], []
        gpu_at = cpu_at = 0
        for g, size in enumerate(group_sizes):
            size = int(size)
            skip = int(block_indices[g]) % factor if block_indices is not None else 0
            if size == 0:
                continue
            if gpu_to_cpu and (skip or size % factor):
                raise ValueError(
                    f"store of group {g} is not aligned to offloaded blocks of {factor} GPU "
                    f"blocks (block index {block_indices[g] if block_indices else 0}, "
                    f"{size} blocks): a store fills whole offloaded blocks"
                )
            rows = -(-(size + skip) // factor)
            group_gpu = gpu_ids[gpu_at : gpu_at + size]
            group_cpu = cpu_ids[cpu_at : cpu_at + rows]
            if len(group_cpu) < rows:
                raise ValueError(
                    f"{direction}: group {g} needs {rows} CPU blocks for {size} GPU blocks "
                    f"(factor {factor}, first at page {skip}), but the CPU spec has only "
                    f"{len(cpu_ids)} in all"
                )
            tensors, strides, offsets, pages, copies, limit = self._group_columns[g]
            if len(tensors) and (group_gpu.min() < 0 or group_gpu.max() >= limit):
                raise ValueError(
                    f"group {g}: GPU block ids must be in [0, {limit}); got "
                    f"{int(group_gpu.min())}..{int(group_gpu.max())}"
                )
            # CPU page q = row * factor + slot, exactly the contract's expansion of the rows
            cpu_pages = np.empty(size, dtype=np.int64)
            expand_block_ids(group_cpu, factor, cpu_pages, skip)
            cpu_rows, cpu_slots = np.divmod(cpu_pages, factor)
            # (tensors x pages) grids, flattened tensor-major: each tensor's pages in spec
            # order, which is what lets coalesce() join consecutive blocks
            shape = (len(tensors), size)
            pieces_t.append(np.broadcast_to(tensors, shape).ravel())
            pieces_gpu.append((group_gpu[None, :] * strides).ravel())
            pieces_cpu.append(
                (cpu_rows[None, :] * self.cpu_row_stride + offsets + cpu_slots[None, :] * pages).ravel()
            )
            pieces_size.append(np.broadcast_to(copies, shape).ravel())
            gpu_at += size
            cpu_at += rows
        if cpu_at != len(cpu_ids):
            raise ValueError(
                f"{direction}: the GPU spec needs {cpu_at} CPU blocks (factor {factor}), "
                f"the CPU spec names {len(cpu_ids)}"
            )
        if not pieces_size:
            return coalesce(*(np.zeros(0, dtype=np.int64),) * 4)
        segments = coalesce(
            np.concatenate(pieces_t),
            np.concatenate(pieces_gpu),
            np.concatenate(pieces_cpu),
            np.concatenate(pieces_size),
        )
        if gpu_to_cpu:
            _check_disjoint(
                np.zeros(len(segments), dtype=np.int64), segments.cpu_offsets, segments.sizes, "CPU"
            )
        else:
            _check_disjoint(segments.tensor_idx, segments.gpu_offsets, segments.sizes, "GPU")
        return segments

"""A worker rig for handler tests, and a page-by-page model of what a transfer must change.

The model is written from the row layout in ``kvtier.worker.blocks``'s docstring, not from
its code: offsets are recomputed here from the page sizes. A transfer is checked by applying
the model to snapshots of every byte (the engine's raw layers, padding and neighbours
included, and the whole CPU region) and comparing all of them afterwards, so a byte written
where it should not be fails the test as surely as a byte that did not arrive.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.base import CanonicalKVCaches
from kvtier.worker.blocks import TransferLayout
from kvtier.worker.canonical import canonicalize
from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers
from kvtier.worker.engines.base import CopyBuffers
from kvtier.worker.engines.thread import memmove_descriptors
from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.cpu.region import SharedRegion


def flat_numpy(pages: torch.Tensor) -> np.ndarray:
    """Every byte a (num_blocks, page) CPU tensor spans, as a writable numpy view."""
    num_blocks, page = pages.shape
    extent = (num_blocks - 1) * pages.stride(0) + page
    return torch.as_strided(pages, (extent,), (1,), pages.storage_offset()).view(torch.uint8).numpy()


def model_copies(kv: CanonicalKVCaches, factor, row_stride, gpu_ids, group_sizes, block_indices, cpu_ids):
    """(tensor, gpu byte offset, cpu byte offset, size) per page the transfer must copy."""
    pages = [entry.page_size_bytes for entry in kv.tensors]
    offsets = [factor * sum(pages[:t]) for t in range(len(pages))]
    copies = []
    gpu_at = cpu_at = 0
    for g, size in enumerate(group_sizes):
        skip = block_indices[g] % factor if block_indices is not None else 0
        uses = {}
        for ref in kv.group_data_refs[g]:
            uses[ref.tensor_idx] = max(uses.get(ref.tensor_idx, 0), ref.page_size_bytes)
        for i in range(size):
            logical = skip + i
            row, slot = cpu_ids[cpu_at + logical // factor], logical % factor
            for t in sorted(uses):
                stride = kv.tensors[t].tensor.stride(0)
                copies.append(
                    (
                        t,
                        gpu_ids[gpu_at + i] * stride,
                        row * row_stride + offsets[t] + slot * pages[t],
                        uses[t],
                    )
                )
        gpu_at += size
        cpu_at += -(-(size + skip) // factor) if size else 0
    return copies


class Rig:
    """Raw layers on ``device``, their canonical views, a CPU region and the handler pair."""

    def __init__(
        self,
        device: str,
        *,
        layers: int = 3,
        num_blocks: int = 12,
        block_shape=(4, 6),
        dtype=torch.bfloat16,
        kv_first: bool = False,
        groups=None,
        factor: int = 1,
        num_rows: int = 8,
        region: SharedRegion | None = None,
        seed: int = 0,
        engine: str = "auto",
    ):
        self.device = device
        self.factor = factor
        self.kv_first = kv_first
        self.groups = groups
        shape = ((2,) if kv_first else ()) + (num_blocks, *block_shape)
        generator = torch.Generator().manual_seed(seed)
        self.layers = [torch.randn(shape, generator=generator).to(dtype).to(device) for _ in range(layers)]
        self.kv = canonicalize(self.layers, kv_first=kv_first, groups=groups)
        self.block_bytes = factor * sum(entry.page_size_bytes for entry in self.kv.tensors)
        self.region = region or SharedRegion.create(num_rows, self.block_bytes)
        self.region.pin("auto")
        self.handlers = CpuGpuOffloadingHandlers(self.kv, self.region, factor, engine=engine)
        self.store_handler = self.handlers.gpu_to_cpu_handler
        self.load_handler = self.handlers.cpu_to_gpu_handler

    def close(self) -> None:
        self.handlers.shutdown()
        self.region.close()

    # --- bytes --------------------------------------------------------------------------

    def region_bytes(self) -> np.ndarray:
        rows = self.region.rows
        return np.lib.stride_tricks.as_strided(
            rows, shape=(rows.shape[0] * self.region.row_stride,), strides=(1,)
        )

    def snapshot(self):
        return [layer.detach().cpu().clone() for layer in self.layers], self.region_bytes().copy()

    def scramble(self, seed: int, *, gpu: bool = True, region: bool = True) -> None:
        """Fill every GPU byte and/or every region byte (padding too) with a fresh pattern."""
        generator = torch.Generator().manual_seed(seed)
        for layer in self.layers if gpu else ():
            raw = layer.view(torch.uint8)
            raw.copy_(
                torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator).to(self.device)
            )
        if region:
            flat = self.region_bytes()
            flat[:] = np.random.default_rng(seed).integers(0, 256, flat.shape, dtype=np.uint8)

    def expected_after(self, copies, gpu_to_cpu):
        layers, region = self.snapshot()
        kv = canonicalize(layers, kv_first=self.kv_first, groups=self.groups)
        gpu = [flat_numpy(entry.tensor) for entry in kv.tensors]
        for t, gpu_at, cpu_at, size in copies:
            if gpu_to_cpu:
                region[cpu_at : cpu_at + size] = gpu[t][gpu_at : gpu_at + size]
            else:
                gpu[t][gpu_at : gpu_at + size] = region[cpu_at : cpu_at + size]
        return layers, region

    def assert_bytes(self, expected) -> None:
        layers, region = expected
        for index, (got, want) in enumerate(zip(self.layers, layers)):
            np.testing.assert_array_equal(
                got.detach().cpu().view(torch.uint8).numpy(),
                want.view(torch.uint8).numpy(),
                err_msg=f"layer {index}",
            )
        np.testing.assert_array_equal(self.region_bytes(), region, err_msg="CPU region")

    # --- jobs -----------------------------------------------------------------------------

    def specs(self, gpu_ids, group_sizes, cpu_ids, block_indices=None, store=True):
        gpu = GPULoadStoreSpec(gpu_ids, group_sizes, block_indices)
        cpu = CPULoadStoreSpec(cpu_ids)
        return (gpu, cpu) if store else (cpu, gpu)

    def transfer(self, job_id, gpu_ids, group_sizes, cpu_ids, block_indices=None, *, store=True):
        """Run one job to completion and check every byte of both sides against the model."""
        copies = model_copies(
            self.kv,
            self.factor,
            self.region.row_stride,
            list(gpu_ids),
            group_sizes,
            block_indices,
            list(cpu_ids),
        )
        expected = self.expected_after(copies, store)
        handler = self.store_handler if store else self.load_handler
        assert handler.transfer_async(job_id, self.specs(gpu_ids, group_sizes, cpu_ids, block_indices, store))
        handler.wait({job_id})
        results = handler.get_finished()
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
            (job_id, True, sum(c[3] for c in copies))
        ]
        self.assert_bytes(expected)
        return copies

    def page(self, layer: int, block: int, half: int = 0) -> np.ndarray:
        raw = self.layers[layer][half] if self.kv_first else self.layers[layer]
        return raw[block].detach().cpu().contiguous().view(torch.uint8).numpy().ravel().copy()


PAGES = (24, 40, 6000)  # multiples of 8: a kernel moves them as 8-byte words


def copier_matches_memmove(copier) -> int:
    """Run ``copier(dsts, srcs, sizes, gpu_to_cpu)`` over the descriptors of both directions of
    a real plan (strided and contiguous CPU tensors standing in for the GPU, a factor of 2)
    and require every byte to match the thread engine's memmove of the same descriptors;
    returns the number of copies compared. For the copy paths that run elsewhere on a GPU
    (a Triton kernel under its interpreter, the driver's batched copy through a stand-in).
    """
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
            copier(*descriptors, gpu_to_cpu)
            np.testing.assert_array_equal(region.rows, want[1])
            for t, expected in zip(gpu, want[0]):
                assert torch.equal(t, expected)
            assert (region.rows != start[1]).any() or any(
                not torch.equal(t, s) for t, s in zip(gpu, start[0])
            ), "the plan copied nothing"
            compared += len(descriptors[2])
    return compared

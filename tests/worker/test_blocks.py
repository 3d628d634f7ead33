"""The worker side's index arithmetic: expand_block_ids, the row layout and the copy plan.

The plan is checked against a page-by-page reference written from the layout's docstring,
by running both on small numpy buffers and comparing every byte (so coalescing, offsets,
skips and groups are all covered), plus table tests of the exact segments for the cases
the issue names.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.worker.blocks import TransferLayout, coalesce, expand_block_ids

# ---------------------------------------------------------------------------------------------
# expand_block_ids


@pytest.mark.parametrize(
    "block_ids, factor, count, skip, expected",
    [
        ([0, 1, 3], 4, 12, 0, [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]),  # the contract's example
        ([0, 1, 3], 4, 5, 2, [2, 3, 4, 5, 6]),
        ([0, 1, 3], 4, 10, 2, [2, 3, 4, 5, 6, 7, 12, 13, 14, 15]),
        ([5, 2], 3, 4, 0, [15, 16, 17, 6]),  # last block used in part
        ([5, 2], 3, 3, 1, [16, 17, 6]),
        ([7, 3, 9], 1, 3, 0, [7, 3, 9]),
        ([7, 3, 9], 1, 2, 0, [7, 3]),
        ([4], 2, 1, 1, [9]),
        ([], 3, 0, 0, []),
    ],
)
def test_expand_block_ids_table(block_ids, factor, count, skip, expected):
    output = np.full(count, -1, dtype=np.int64)
    expand_block_ids(np.array(block_ids, dtype=np.int64), factor, output, skip)
    assert output.tolist() == expected


def test_expand_block_ids_writes_only_its_output_slice():
    buffer = np.full(8, -1, dtype=np.int64)
    expand_block_ids(np.array([2]), 2, buffer[3:5])
    assert buffer.tolist() == [-1, -1, -1, 4, 5, -1, -1, -1]


@pytest.mark.parametrize("skip", [-1, 4, 5])
def test_expand_block_ids_rejects_skip_outside_factor(skip):
    with pytest.raises(ValueError, match="skip_count"):
        expand_block_ids(np.array([0, 1]), 4, np.empty(2, dtype=np.int64), skip)


def test_expand_block_ids_rejects_too_long_output():
    with pytest.raises(ValueError, match="hold only 5"):
        expand_block_ids(np.array([0, 1]), 3, np.empty(6, dtype=np.int64), 1)


def test_expand_block_ids_rejects_bad_factor():
    with pytest.raises(ValueError, match="block_size_factor"):
        expand_block_ids(np.array([0]), 0, np.empty(0, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# coalesce


def test_coalesce_joins_only_where_both_sides_continue():
    t = np.array([0, 0, 0, 0, 1, 1])
    gpu = np.array([0, 10, 20, 40, 50, 60])
    cpu = np.array([100, 110, 120, 130, 140, 150])
    size = np.array([10, 10, 10, 10, 10, 10])
    merged = coalesce(t, gpu, cpu, size)
    # 0-2 join; 3 breaks on the GPU side; 4 starts another tensor; 5 continues 4
    assert merged.tensor_idx.tolist() == [0, 0, 1]
    assert merged.gpu_offsets.tolist() == [0, 40, 50]
    assert merged.cpu_offsets.tolist() == [100, 130, 140]
    assert merged.sizes.tolist() == [30, 10, 20]
    assert merged.nbytes == 60


def test_coalesce_empty():
    empty = np.zeros(0, dtype=np.int64)
    merged = coalesce(empty, empty, empty, empty)
    assert len(merged) == 0 and merged.nbytes == 0


# ---------------------------------------------------------------------------------------------
# the layout


def layout(pages=(8, 16), factor=1, groups=None, num_blocks=10, strides=None, rows=6, row_stride=None):
    groups = groups if groups is not None else [list(pages)]
    block = factor * sum(pages)
    return TransferLayout(
        page_bytes=pages,
        block_size_factor=factor,
        group_copy_bytes=groups,
        gpu_num_blocks=[num_blocks] * len(pages),
        gpu_block_strides=list(strides or pages),
        cpu_num_rows=rows,
        cpu_row_stride=row_stride or block,
    )


def test_row_layout_offsets_follow_tensor_order():
    lay = layout(pages=(8, 16, 4), factor=3)
    assert lay.tensor_offsets == (0, 24, 72)
    assert lay.block_bytes == 84


def test_plan_store_factor_1_one_copy_per_page():
    lay = layout(pages=(8, 16))
    seg = lay.plan(np.array([4, 2]), [2], None, np.array([1, 3]), gpu_to_cpu=True)
    # tensor-major: tensor 0's pages, then tensor 1's; rows are 24 bytes
    assert seg.tensor_idx.tolist() == [0, 0, 1, 1]
    assert seg.gpu_offsets.tolist() == [32, 16, 64, 32]
    assert seg.cpu_offsets.tolist() == [24, 72, 32, 80]
    assert seg.sizes.tolist() == [8, 8, 16, 16]
    assert seg.nbytes == 48


def test_plan_store_factor_3_coalesces_consecutive_blocks_into_one_copy_per_tensor():
    lay = layout(pages=(8, 16), factor=3)
    seg = lay.plan(np.array([3, 4, 5]), [3], None, np.array([2]), gpu_to_cpu=True)
    row = 2 * lay.block_bytes
    assert seg.tensor_idx.tolist() == [0, 1]
    assert seg.gpu_offsets.tolist() == [24, 48]
    assert seg.cpu_offsets.tolist() == [row, row + 24]
    assert seg.sizes.tolist() == [24, 48]


def test_plan_load_unaligned_first_block_and_partial_last():
    lay = layout(pages=(8,), factor=3)
    seg = lay.plan(np.array([9, 1, 2, 3]), [4], [4], np.array([5, 0]), gpu_to_cpu=False)
    # page 1 of row 5 -> block 9; page 2 of row 5 -> block 1; pages 0,1 of row 0 -> blocks 2,3
    assert list(zip(seg.gpu_offsets.tolist(), seg.cpu_offsets.tolist(), seg.sizes.tolist())) == [
        (72, 128, 8),
        (8, 136, 8),
        (16, 0, 16),
    ]


def test_plan_groups_in_order_with_an_empty_group_and_tensor_subsets():
    # three groups: g0 uses tensor 0, g1 uses nothing this time (size 0), g2 uses tensor 1 only
    lay = layout(pages=(8, 16), groups=[[8, 0], [8, 16], [0, 12]])
    seg = lay.plan(np.array([1, 2, 7]), [2, 0, 1], None, np.array([0, 1, 4]), gpu_to_cpu=True)
    assert seg.tensor_idx.tolist() == [0, 0, 1]
    assert seg.gpu_offsets.tolist() == [8, 16, 7 * 16]
    assert seg.cpu_offsets.tolist() == [0, 24, 4 * 24 + 8]
    assert seg.sizes.tolist() == [8, 8, 12]  # group 2's un-padded page size


def test_plan_respects_gpu_block_stride():
    lay = layout(pages=(8,), strides=[24], num_blocks=4)
    seg = lay.plan(np.array([1, 2]), [2], None, np.array([0, 1]), gpu_to_cpu=True)
    assert seg.gpu_offsets.tolist() == [24, 48]  # not contiguous: two copies
    assert seg.sizes.tolist() == [8, 8]


def test_plan_respects_padded_cpu_rows():
    lay = layout(pages=(8,), row_stride=4096)
    seg = lay.plan(np.array([0, 1]), [2], None, np.array([2, 3]), gpu_to_cpu=True)
    assert seg.cpu_offsets.tolist() == [8192, 12288]


def test_plan_empty_spec():
    lay = layout()
    seg = lay.plan(np.zeros(0, dtype=np.int64), [0], None, np.zeros(0, dtype=np.int64), gpu_to_cpu=True)
    assert len(seg) == 0 and seg.nbytes == 0


# ---------------------------------------------------------------------------------------------
# malformed specs


@pytest.mark.parametrize(
    "gpu, sizes, indices, cpu, store, match",
    [
        ([0, 1], [2], None, [0], True, "needs 2 CPU blocks"),  # too few CPU blocks
        ([0, 1], [2], None, [0, 1, 2], True, "names 3"),  # too many
        ([0, 1], [1, 1], None, [0, 1], True, "groups"),  # group count differs from the cache's
        ([0, 1], [3], None, [0, 1], True, "partition"),
        ([0, 1], [2], [0, 0], [0, 1], False, "block_indices"),
        ([0, 99], [2], None, [0, 1], True, r"GPU block ids must be in \[0, 10\)"),
        ([0, -1], [2], None, [0, 1], False, "GPU block ids"),
        ([0, 1], [2], None, [0, 6], True, r"CPU block ids must be in \[0, 6\)"),
        ([0, 1], [2], None, [3, 3], True, "same CPU bytes"),  # two blocks into one row
        ([4, 4], [2], None, [0, 1], False, "same GPU bytes"),  # two rows into one block
    ],
)
def test_plan_rejects_malformed_specs(gpu, sizes, indices, cpu, store, match):
    lay = layout()
    with pytest.raises(ValueError, match=match):
        lay.plan(np.array(gpu), sizes, indices, np.array(cpu), gpu_to_cpu=store)


@pytest.mark.parametrize("sizes, indices", [([2], [0]), ([3], [4]), ([3], [1]), ([4], None)])
def test_unaligned_store_is_refused(sizes, indices):
    lay = layout(factor=3)
    ids = np.arange(sum(sizes))
    with pytest.raises(ValueError, match="not aligned"):
        lay.plan(ids, sizes, indices, np.array([0, 1]), gpu_to_cpu=True)


def test_aligned_store_with_block_indices_is_accepted():
    lay = layout(factor=3)
    seg = lay.plan(np.arange(3), [3], [6], np.array([1]), gpu_to_cpu=True)
    assert seg.nbytes == lay.block_bytes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"groups": [[9, 16]]}, "uses 9 bytes"),
        ({"groups": [[8]]}, "lists 1 tensors"),
        ({"strides": [4, 16]}, "block stride 4"),
        ({"row_stride": 10}, "cannot hold"),
        ({"factor": 0}, "block_size_factor"),
    ],
)
def test_layout_rejects_inconsistent_geometry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layout(**kwargs)


# ---------------------------------------------------------------------------------------------
# property: the plan moves exactly the bytes a page-by-page reading of the layout says


def reference_copies(lay, gpu_ids, group_sizes, block_indices, cpu_ids):
    """(tensor, gpu byte offset, cpu byte offset, size) per page, straight from the docstring."""
    copies = []
    gpu_at = cpu_at = 0
    for g, size in enumerate(group_sizes):
        skip = block_indices[g] % lay.factor if block_indices is not None else 0
        if size == 0:
            continue
        for i in range(size):
            page = skip + i
            row = cpu_ids[cpu_at + page // lay.factor]
            slot = page % lay.factor
            for t, copy in enumerate(lay.group_copy_bytes[g]):
                if copy:
                    copies.append(
                        (
                            t,
                            gpu_ids[gpu_at + i] * lay.gpu_block_strides[t],
                            row * lay.cpu_row_stride + lay.tensor_offsets[t] + slot * lay.page_bytes[t],
                            copy,
                        )
                    )
        gpu_at += size
        cpu_at += -(-(size + skip) // lay.factor)
    return copies


def apply(copies, gpu_buffers, cpu_buffer, gpu_to_cpu):
    for t, gpu_at, cpu_at, size in copies:
        if gpu_to_cpu:
            cpu_buffer[cpu_at : cpu_at + size] = gpu_buffers[t][gpu_at : gpu_at + size]
        else:
            gpu_buffers[t][gpu_at : gpu_at + size] = cpu_buffer[cpu_at : cpu_at + size]


@st.composite
def transfers(draw):
    num_tensors = draw(st.integers(1, 3))
    pages = [draw(st.sampled_from([8, 16, 24])) for _ in range(num_tensors)]
    factor = draw(st.integers(1, 3))
    num_groups = draw(st.integers(1, 3))
    groups = [[draw(st.sampled_from([0, page // 2, page])) for page in pages] for _ in range(num_groups)]
    strides = [page + draw(st.sampled_from([0, 0, 8])) for page in pages]
    num_blocks, num_rows = 16, 12
    row_stride = factor * sum(pages) + draw(st.sampled_from([0, 8]))
    lay = TransferLayout(
        page_bytes=pages,
        block_size_factor=factor,
        group_copy_bytes=groups,
        gpu_num_blocks=[num_blocks] * num_tensors,
        gpu_block_strides=strides,
        cpu_num_rows=num_rows,
        cpu_row_stride=row_stride,
    )
    store = draw(st.booleans())
    sizes, indices, rows_needed = [], [], 0
    for _ in range(num_groups):
        if store:
            size = factor * draw(st.integers(0, 2))
            index = factor * draw(st.integers(0, 3))
        else:
            size = draw(st.integers(0, 4))
            index = draw(st.integers(0, 7))
        sizes.append(size)
        indices.append(index)
        if size:
            rows_needed += -(-(size + index % factor) // factor)
    if rows_needed > num_rows or sum(sizes) > num_blocks:
        sizes = [0] * num_groups
        rows_needed = 0
    use_indices = draw(st.booleans())
    block_indices = indices if use_indices else None
    if block_indices is None:
        rows_needed = sum(-(-size // factor) for size in sizes)
    # a permutation prefix: distinct ids, sometimes consecutive runs, so coalescing happens
    consecutive = draw(st.booleans())
    gpu_ids = (
        np.arange(sum(sizes)) + min(2, num_blocks - sum(sizes))
        if consecutive
        else draw(st.permutations(range(num_blocks)))[: sum(sizes)]
    )
    cpu_ids = np.arange(rows_needed) if consecutive else draw(st.permutations(range(num_rows)))[:rows_needed]
    return (
        lay,
        np.array(gpu_ids, dtype=np.int64),
        sizes,
        block_indices,
        np.array(cpu_ids, dtype=np.int64),
        store,
    )


@settings(max_examples=150, deadline=None)
@given(transfers())
def test_plan_moves_exactly_the_reference_bytes(case):
    lay, gpu_ids, sizes, indices, cpu_ids, store = case
    rng = np.random.default_rng(0)
    extent = [
        (lay.gpu_num_blocks[t] - 1) * lay.gpu_block_strides[t] + lay.page_bytes[t]
        for t in range(len(lay.page_bytes))
    ]
    gpu_start = [rng.integers(0, 256, n, dtype=np.uint8) for n in extent]
    cpu_start = rng.integers(0, 256, lay.cpu_num_rows * lay.cpu_row_stride, dtype=np.uint8)

    expected_gpu, expected_cpu = [b.copy() for b in gpu_start], cpu_start.copy()
    reference = reference_copies(lay, gpu_ids, sizes, indices, cpu_ids)
    apply(reference, expected_gpu, expected_cpu, store)

    segments = lay.plan(gpu_ids, sizes, indices, cpu_ids, gpu_to_cpu=store)
    got_gpu, got_cpu = [b.copy() for b in gpu_start], cpu_start.copy()
    planned = list(
        zip(
            segments.tensor_idx.tolist(),
            segments.gpu_offsets.tolist(),
            segments.cpu_offsets.tolist(),
            segments.sizes.tolist(),
        )
    )
    apply(planned, got_gpu, got_cpu, store)

    assert segments.nbytes == sum(copy[3] for copy in reference)
    assert len(segments) <= len(reference)
    np.testing.assert_array_equal(got_cpu, expected_cpu)
    for got, want in zip(got_gpu, expected_gpu):
        np.testing.assert_array_equal(got, want)

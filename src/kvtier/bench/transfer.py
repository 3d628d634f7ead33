"""``kvtier bench transfer``: GPU<->CPU handler throughput against one contiguous copy.

    kvtier bench transfer [--json] [--device auto|cpu|cuda] [--max-batch 512] [--runs 5] [--layers 32]

Layouts (one canonical tensor per layer, K and V of a block together, 16-token GPU blocks):

* ``llama3-8b``: 8 KV heads x head dim 128 x bf16 x 16 tokens x (K, V) = 64 KiB per layer and
  block, 32 layers, so an offloaded block (one CPU row) is 2 MiB;
* ``small-page``: 16 KiB per layer and block (e.g. 4-token blocks, or 2 KV heads), 32 layers.

For each layout and each batch of 1, 2, 4, ... ``max_batch`` blocks, the median of ``runs``
runs of:

* ``d2h``: one store job through the real handler (GPU blocks in a random order, as a block
  pool hands them out after a while, into consecutive CPU rows, as a fresh CPU tier hands
  them out), timed from ``transfer_async`` until ``wait`` returns;
* ``h2d``: one load job of those rows back into other GPU blocks, timed the same way;
* ``baseline``: one contiguous copy of the same byte count between a device buffer and the
  same CPU rows, in each direction (on CUDA ``Tensor.copy_`` with pinned memory: the PCIe
  limit; on the CPU path one ``memmove``). The ratios compare each direction with its own
  baseline; ``baseline_gbps`` is the lower of the two.

On CUDA the rows must pin (``cudaHostRegister``) or the run stops: the baseline is a pinned
copy, and pageable rows would compare two staged paths. There each row also has
``d2h_device_gbps`` and ``h2d_device_gbps``: the DMA jobs' bytes over the time between the
events on their stream, the copies alone; against ``d2h_gbps``/``h2d_gbps`` (from
``transfer_async`` until ``wait`` returns) it shows what planning and submitting cost on the
host.

At the end, one store and one load of up to 64 blocks are checked byte for byte
(``verified`` in the JSON).

On CUDA with Triton importable (PyTorch's CUDA builds bring it), the same jobs also run
through a second handler pair on the ``kernel`` engine (the bytes moved by a Triton kernel
instead of the copy engines; :mod:`kvtier.worker.engines.kernel`), in the same rounds:
``d2h_kernel_gbps``, ``h2d_kernel_gbps`` and their ratios to the same baselines, and its
round trip is verified too. ``kernel=False`` (``--no-kernel``) leaves it out; a kernel engine
that cannot start is left out too, its reason in ``kernel_error``.

On a machine without CUDA the "GPU" tensors are CPU tensors and the handlers run on the CPU
path (a background thread of ``memmove`` calls), so the figures measure that path against a
single ``memcpy`` of the same bytes: useful to see per-copy overhead, not PCIe. Memory used:
about 3 x ``max_batch`` x the block size (3 GiB at the defaults).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from statistics import median
from typing import Any, TextIO

import numpy as np

from kvtier.bench.report import print_table
from kvtier.errors import ConfigError

KiB = 1024
#: name -> bytes per layer and block
LAYOUTS = (("llama3-8b", 64 * KiB), ("small-page", 16 * KiB))
VERIFY_BLOCKS = 64


def fill_layer(layer: Any, layer_index: int, torch: Any) -> None:
    """Bytes unique to each (block, layer): a random page plus the block id, and both ids stamped in."""
    num_blocks, page = layer.shape
    generator = torch.Generator(device="cpu").manual_seed(layer_index)
    pattern = torch.randint(0, 256, (page,), dtype=torch.uint8, generator=generator).to(layer.device)
    raw = layer.view(torch.uint8)
    raw.copy_(pattern.unsqueeze(0).expand(num_blocks, page))
    raw += (torch.arange(num_blocks, device=layer.device) % 256).to(torch.uint8).unsqueeze(1)
    stamp = np.zeros((num_blocks, 8), dtype=np.uint8)
    stamp[:, :4] = np.arange(num_blocks, dtype="<u4").view(np.uint8).reshape(num_blocks, 4)
    stamp[:, 4:] = np.frombuffer(np.uint32(layer_index).tobytes(), dtype=np.uint8)
    raw[:, :8] = torch.from_numpy(stamp).to(layer.device)


class Clock:
    """Wall-clock timing that waits for the device first, so each figure starts idle."""

    def __init__(self, torch: Any, cuda: bool):
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)

    def time(self, action: Any) -> float:
        self._sync()
        started = time.perf_counter()
        action()
        self._sync()
        return time.perf_counter() - started


def run_job(handler: Any, job_id: int, spec: tuple) -> float | None:
    """Run one job to completion; return the time its copies took as the engine measured it
    (on CUDA between events on the job's stream: the device's part alone)."""
    if not handler.transfer_async(job_id, spec):
        raise RuntimeError(f"job {job_id} was not queued")
    handler.wait({job_id})
    results = handler.get_finished()
    if [r.job_id for r in results] != [job_id] or not results[0].success:
        raise RuntimeError(f"job {job_id} did not finish cleanly: {results}")
    return results[0].transfer_time


def _bench_layout(
    name: str,
    page_bytes: int,
    *,
    device: str,
    max_batch: int,
    runs: int,
    layers: int,
    torch: Any,
    kernel: bool = False,
    kernel_error: list[str] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """One layout's rows and whether its round trips were exact. A kernel engine that cannot
    start is appended to ``kernel_error`` and left out; everything else raises."""
    kernel_error = [] if kernel_error is None else kernel_error
    from kvtier.worker.canonical import canonicalize
    from kvtier.worker.cpu_gpu import CpuGpuOffloadingHandlers
    from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec
    from kvtier.tiers.cpu.region import SharedRegion

    cuda = device == "cuda"
    clock = Clock(torch, cuda)
    num_blocks = max_batch
    block_bytes = layers * page_bytes
    caches = [torch.empty((num_blocks, page_bytes), dtype=torch.int8, device=device) for _ in range(layers)]
    for index, layer in enumerate(caches):
        fill_layer(layer, index, torch)
    kv_caches = canonicalize(caches)
    region = SharedRegion.create(max_batch, block_bytes)
    handlers = kernel_handlers = None
    try:
        # On CUDA the figures are only meaningful with pinned rows (the baseline is "one
        # contiguous pinned copy"): refuse rather than compare two pageable paths.
        region.pin("on" if cuda else "auto")
        handlers = CpuGpuOffloadingHandlers(kv_caches, region, 1, engine="auto")
        store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
        if kernel:
            try:
                kernel_handlers = CpuGpuOffloadingHandlers(kv_caches, region, 1, engine="kernel")
            except Exception as exc:  # noqa: BLE001 - reported; the DMA figures still count
                kernel_error.append(f"{type(exc).__name__}: {exc}")
        host = handlers.buffers.cpu
        device_buffer = torch.empty(max_batch * block_bytes, dtype=torch.int8, device=device)
        rng = np.random.default_rng(0)
        store_ids = rng.permutation(num_blocks)
        load_ids = rng.permutation(num_blocks)
        job_ids = iter(range(1 << 62))

        # the engine's own time of each timed DMA job, by direction and batch
        device_s: dict[tuple[str, int], list[float]] = {}

        def store_job(count: int, handler: Any = store) -> None:
            spec = (
                GPULoadStoreSpec(store_ids[:count], [count]),
                CPULoadStoreSpec(np.arange(count)),
            )
            took = run_job(handler, next(job_ids), spec)
            if handler is store and took is not None:
                device_s.setdefault(("d2h", count), []).append(took)

        def load_job(count: int, handler: Any = load) -> None:
            spec = (CPULoadStoreSpec(np.arange(count)), GPULoadStoreSpec(load_ids[:count], [count]))
            took = run_job(handler, next(job_ids), spec)
            if handler is load and took is not None:
                device_s.setdefault(("h2d", count), []).append(took)

        def baseline(count: int, to_host: bool) -> None:
            nbytes = count * block_bytes
            if not cuda:
                # the same memmove the thread engine runs, once over all the bytes; torch's
                # CPU copy_ is no yardstick here (about 8 ms of fixed cost per call on this
                # machine kind, thread-pool wake-ups)
                dst, src = (host, device_buffer) if to_host else (device_buffer, host)
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            elif to_host:
                host[:nbytes].copy_(device_buffer[:nbytes], non_blocking=True)
            else:
                device_buffer[:nbytes].copy_(host[:nbytes], non_blocking=True)

        # first touch of the shared rows (page faults) and of every code path (the kernel's
        # compilation too), untimed
        store_job(max_batch)
        load_job(max_batch)
        baseline(max_batch, True)
        baseline(max_batch, False)
        if kernel_handlers is not None:
            store_job(max_batch, kernel_handlers.gpu_to_cpu_handler)
            load_job(max_batch, kernel_handlers.cpu_to_gpu_handler)

        rows = []
        batch = 1
        while batch <= max_batch:
            nbytes = batch * block_bytes
            actions = {
                "d2h": lambda count=batch: store_job(count),
                "h2d": lambda count=batch: load_job(count),
                "baseline_d2h": lambda count=batch: baseline(count, True),
                "baseline_h2d": lambda count=batch: baseline(count, False),
            }
            if kernel_handlers is not None:
                actions["d2h_kernel"] = lambda count=batch: store_job(
                    count, kernel_handlers.gpu_to_cpu_handler
                )
                actions["h2d_kernel"] = lambda count=batch: load_job(
                    count, kernel_handlers.cpu_to_gpu_handler
                )
            figures = {
                name: median(clock.time(action) for _ in range(runs)) for name, action in actions.items()
            }
            gbps = {key: nbytes / seconds / 1e9 for key, seconds in figures.items()}
            row = {
                "layout": name,
                "page_bytes": page_bytes,
                "batch_blocks": batch,
                "d2h_gbps": gbps["d2h"],
                "h2d_gbps": gbps["h2d"],
                "baseline_d2h_gbps": gbps["baseline_d2h"],
                "baseline_h2d_gbps": gbps["baseline_h2d"],
                "baseline_gbps": min(gbps["baseline_d2h"], gbps["baseline_h2d"]),
                "d2h_ratio": gbps["d2h"] / gbps["baseline_d2h"],
                "h2d_ratio": gbps["h2d"] / gbps["baseline_h2d"],
            }
            if cuda:
                # the copies alone, from events on the job's stream: against the wall-clock
                # figure above, what planning and submitting cost on the host
                for direction in ("d2h", "h2d"):
                    row[f"{direction}_device_gbps"] = (
                        nbytes / median(device_s[(direction, batch)][-runs:]) / 1e9
                    )
            for direction in ("d2h", "h2d") if kernel_handlers is not None else ():
                row[f"{direction}_kernel_gbps"] = gbps[f"{direction}_kernel"]
                row[f"{direction}_kernel_ratio"] = gbps[f"{direction}_kernel"] / gbps[f"baseline_{direction}"]
            rows.append(row)
            batch *= 2

        verified = _verify(caches, store, load, min(VERIFY_BLOCKS, max_batch), rng, torch)
        if kernel_handlers is not None:
            verified = verified and _verify(
                caches,
                kernel_handlers.gpu_to_cpu_handler,
                kernel_handlers.cpu_to_gpu_handler,
                min(VERIFY_BLOCKS, max_batch),
                rng,
                torch,
            )
        return rows, verified
    finally:
        for pair in (kernel_handlers, handlers):
            if pair is not None:
                pair.shutdown()
        region.close()


def _verify(caches: list, store: Any, load: Any, count: int, rng: np.random.Generator, torch: Any) -> bool:
    """Store ``count`` blocks, load them into other blocks, compare every byte."""
    from kvtier.mediums import CPULoadStoreSpec, GPULoadStoreSpec

    num_blocks = caches[0].shape[0]
    order = rng.permutation(num_blocks)
    sources = order[:count]
    # destinations differ from the sources wherever there is room, so a no-op cannot pass
    targets = order[count : 2 * count] if 2 * count <= num_blocks else np.roll(sources, 1)
    index = torch.from_numpy(sources).to(caches[0].device)
    expected = [layer.index_select(0, index).cpu() for layer in caches]
    rows = np.arange(count)
    run_job(store, -1, (GPULoadStoreSpec(sources, [count]), CPULoadStoreSpec(rows)))
    for layer in caches:
        layer.index_fill_(0, torch.from_numpy(targets).to(layer.device), 0)
    run_job(load, -2, (CPULoadStoreSpec(rows), GPULoadStoreSpec(targets, [count])))
    target_index = torch.from_numpy(targets).to(caches[0].device)
    return all(
        torch.equal(layer.index_select(0, target_index).cpu(), want) for layer, want in zip(caches, expected)
    )


def run(
    *,
    device: str = "auto",
    max_batch: int = 512,
    runs: int = 5,
    layers: int = 32,
    out: TextIO | None = None,
    kernel: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; print the table; return the JSON record (the CLI prints it with --json).

    ``kernel``: on CUDA, also time the kernel engine, where Triton imports."""
    out = out or sys.stdout
    import torch

    from kvtier.cuda import resolve_device

    try:
        device = resolve_device(device)
    except ConfigError as exc:
        raise SystemExit(f"kvtier bench transfer: {exc}") from None
    if max_batch < 1 or runs < 1 or layers < 1:
        raise SystemExit("kvtier bench transfer: --max-batch, --runs and --layers must be >= 1")
    from importlib.util import find_spec

    kernel = kernel and device == "cuda" and find_spec("triton") is not None
    rows: list[dict[str, Any]] = []
    verified = True
    kernel_error: list[str] = []
    for name, page_bytes in LAYOUTS:
        layout_rows, layout_ok = _bench_layout(
            name,
            page_bytes,
            device=device,
            max_batch=max_batch,
            runs=runs,
            layers=layers,
            torch=torch,
            kernel=kernel and not kernel_error,
            kernel_error=kernel_error,
        )
        rows += layout_rows
        verified = verified and layout_ok
        gc.collect()  # free this layout's buffers before the next one allocates
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    record = {
        "bench": "transfer",
        "device": device_name,
        "engine": "cuda" if device == "cuda" else "thread",
        "engines": (
            (["cuda", "kernel"] if kernel and not kernel_error else ["cuda"])
            if device == "cuda"
            else ["thread"]
        ),
        "layers": layers,
        "runs": runs,
        "verified": verified,
        "rows": rows,
    }
    if kernel_error:
        record["kernel_error"] = kernel_error[0]
    what = (
        "CUDA streams vs one contiguous pinned copy (PCIe)"
        if device == "cuda"
        else "the CPU path (thread engine, CPU tensors as the GPU cache) vs one memcpy; no PCIe here"
    )
    print(
        f"kvtier bench transfer on {device_name}: {what}; {layers} layers, median of {runs} runs; "
        f"round trip verified: {verified}",
        file=out,
    )
    columns = [
        "layout",
        "page_bytes",
        "batch_blocks",
        "d2h_gbps",
        "h2d_gbps",
        "baseline_d2h_gbps",
        "baseline_h2d_gbps",
        "d2h_ratio",
        "h2d_ratio",
    ]
    if device == "cuda":
        columns += ["d2h_device_gbps", "h2d_device_gbps"]
    if kernel and not kernel_error:
        columns += ["d2h_kernel_ratio", "h2d_kernel_ratio"]
    if kernel_error:
        print(f"kernel engine left out: {kernel_error[0]}", file=out)
    print_table(rows, columns, out)
    return record
